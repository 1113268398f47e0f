"""Training data: Megatron indexed datasets (``.bin``/``.idx``) and megatron-core's mock dataset.

Samples are addressed by a global index, ``iteration * global_batch_size + offset``, so a resumed
run reads exactly the samples an uninterrupted run would have read.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy
import torch

from megatron_charm.train.config import Config
from megatron_charm.train.tokenizer import ByteTokenizer

#: Prefix of the corpus shipped with the package (``data.path: [tiny]``).
TINY_CORPUS_PREFIX = Path(__file__).resolve().parent / "data" / "tiny_corpus"
TINY_CORPUS_TEXT = TINY_CORPUS_PREFIX.with_suffix(".txt")


def read_documents(text: str) -> list[str]:
    """Split text into documents at blank lines."""
    return [doc.strip() for doc in text.split("\n\n") if doc.strip()]


def write_indexed_dataset(
    documents: Sequence[str], prefix: str | Path, tokenizer: ByteTokenizer | None = None
) -> tuple[Path, Path]:
    """Tokenize documents (each followed by end-of-document) into a Megatron ``.bin``/``.idx``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteTokenizer()
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    builder = IndexedDatasetBuilder(str(bin_path), dtype=numpy.uint16)
    for doc in documents:
        ids = tokenizer.tokenize(doc) + [tokenizer.eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(str(idx_path))
    return bin_path, idx_path


def resolve_blend(paths: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` semantics: ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``."""
    items = [str(p) for p in paths]
    if not items:
        raise ValueError("data.path is empty: give at least one dataset prefix, or 'tiny'.")

    def expand(p: str) -> str:
        return str(TINY_CORPUS_PREFIX) if p == "tiny" else p

    def is_number(p: str) -> bool:
        try:
            float(p)
        except ValueError:
            return False
        return True

    if len(items) % 2 == 0 and all(is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        prefixes = [expand(p) for p in items[1::2]]
    else:
        weights, prefixes = None, [expand(p) for p in items]
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise ValueError(
                    f"data.path: {prefix + suffix} does not exist. Give the prefix of a Megatron "
                    "indexed dataset (the path without .bin/.idx), or 'tiny' for the shipped "
                    "corpus, or set data.kind=mock."
                )
    return prefixes, weights


def build_train_dataset(cfg: Config, tokenizer: ByteTokenizer, num_samples: int) -> object:
    """Build the training split with megatron-core's dataset builder (collective over all ranks)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None
    if cfg.data.kind == "indexed":
        blend = resolve_blend(cfg.data.path)
    cache = cfg.data.cache_dir or str(cfg.run_dir / "data_cache")
    ds_config = GPTDatasetConfig(
        random_seed=cfg.run.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split="100,0,0",
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=cfg.data.reset_attention_mask,
        reset_attention_mask=cfg.data.reset_attention_mask,
        eod_mask_loss=False,
        # the dense [1, s, s] mask only when documents need it (CHARM+ reads them from it)
        create_attention_mask=cfg.data.reset_attention_mask,
    )
    cls = MockGPTDataset if cfg.data.kind == "mock" else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        cls, [num_samples, 0, 0], lambda: True, ds_config
    ).build()
    return train


def get_microbatch(
    dataset: object,
    iteration: int,
    microbatch: int,
    cfg: Config,
    dp_rank: int,
    dp_size: int,
) -> dict[str, torch.Tensor]:
    """The full-sequence microbatch of one data-parallel rank.

    Returns ``tokens``, ``labels``, ``position_ids`` (int64) and ``loss_mask`` (float32), each
    ``[micro_batch_size, seq_length]``, and with ``data.reset_attention_mask`` the boolean
    document mask ``attention_mask`` ``[micro_batch_size, 1, seq_length, seq_length]`` (``True``:
    masked).
    """
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    first = iteration * gbs + microbatch * mbs * dp_size + dp_rank * mbs
    samples = [dataset[first + k] for k in range(mbs)]
    keys = ["tokens", "labels", "position_ids", "loss_mask"]
    if cfg.data.reset_attention_mask:
        keys.append("attention_mask")
    return {key: torch.stack([s[key] for s in samples]) for key in keys}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m megatron_charm.train.data --input corpus.txt --output-prefix out/corpus``."""
    parser = argparse.ArgumentParser(
        description="Turn a text file (documents separated by blank lines) into a Megatron "
        "indexed dataset with the byte tokenizer."
    )
    parser.add_argument("--input", required=True, help="UTF-8 text file")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    args = parser.parse_args(argv)
    docs = read_documents(Path(args.input).read_text(encoding="utf-8"))
    bin_path, idx_path = write_indexed_dataset(docs, args.output_prefix)
    print(f"wrote {len(docs)} documents to {bin_path} and {idx_path}")


if __name__ == "__main__":
    main()
