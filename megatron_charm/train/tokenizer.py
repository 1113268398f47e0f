"""A byte-level tokenizer: needs no vocabulary file, no download, and round-trips any text."""

from __future__ import annotations


class ByteTokenizer:
    """Token ids 0-255 are the UTF-8 bytes; 256 ends a document; 257 pads.

    It provides what megatron-core's GPT datasets read from a tokenizer (``vocab_size``, ``eod``,
    ``pad``), plus ``tokenize``/``detokenize``.
    """

    eod: int = 256
    pad: int = 257
    vocab_size: int = 258

    def __init__(self) -> None:
        # megatron-core hashes this into its dataset cache keys.
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": self.vocab_size}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Round the vocabulary up as Megatron does, so the embedding has a friendly size."""
    return ((vocab_size + divisible_by - 1) // divisible_by) * divisible_by
