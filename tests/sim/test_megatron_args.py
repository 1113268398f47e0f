"""``megatron-charm-sim --megatron``: the attention layer and CP group of a Megatron-LM launch."""

from __future__ import annotations

import pytest

from megatron_charm.sim.cli import main
from megatron_charm.sim.megatron_args import MegatronLayer, against_current, layer_from_megatron
from tests.sim.cli_json import run_json

LLAMA = (
    "--num-layers 32 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
    "--hidden-size 4096 --seq-length 131072 --micro-batch-size 2 --tensor-model-parallel-size 2 "
    "--context-parallel-size 16 --bf16 --use-distributed-optimizer"
)

#: LLAMA's problem as the simulator's own flags.
FLAGS = (
    "--gpus 4x4 --batch 2 --seq 131072 --heads 32 --kv-heads 8 --head-dim 128 --causal --tp 2 "
    "--groups-per-node 2 --dtype-bytes 2"
).split()


def test_a_llama_launch_line() -> None:
    assert layer_from_megatron(LLAMA, 8) == MegatronLayer(
        batch=2,
        seq=131072,
        heads=32,
        kv_heads=8,
        head_dim=128,
        dtype_bytes=2,
        tp=2,
        nodes=4,
        ranks_per_node=4,
        groups_per_node=2,
    )


@pytest.mark.parametrize(
    ("text", "gpus", "want"),
    [
        # without --group-query-attention Megatron gives every head its own kv head
        ("--num-attention-heads 16 --num-query-groups 4 --hidden-size 2048", 8, (16, 16, 128)),
        # --kv-channels is the head dim, whatever the hidden size
        ("--num-attention-heads 16 --hidden-size 2048 --kv-channels 64", 8, (16, 16, 64)),
        ("--num-attention-heads 12 --hidden-size 2304 --group-query-attention", 8, (12, 1, 192)),
    ],
)
def test_heads_and_head_dim(text: str, gpus: int, want: tuple) -> None:
    layer = layer_from_megatron(f"{text} --seq-length 8192 --context-parallel-size 8", gpus)
    assert (layer.heads, layer.kv_heads, layer.head_dim) == want
    assert (layer.batch, layer.dtype_bytes) == (1, 4)  # Megatron's defaults: fp32, batch 1


@pytest.mark.parametrize(
    ("sizes", "gpus", "layout"),
    [
        ("--context-parallel-size 4", 8, (1, 4, 2)),  # one node holds the group, twice over
        ("--context-parallel-size 8", 8, (1, 8, 1)),
        ("--context-parallel-size 16 --tensor-model-parallel-size 4", 8, (8, 2, 4)),
        ("--context-parallel-size 2 --tensor-model-parallel-size 8", 8, (2, 1, 8)),
        ("--context-parallel-size 4 --fp16", 4, (1, 4, 1)),
        ("--context-parallel-size 12 --tensor-model-parallel-size 2", 8, (3, 4, 2)),
    ],
)
def test_the_cp_group_over_the_nodes(sizes: str, gpus: int, layout: tuple) -> None:
    text = f"--num-attention-heads 8 --hidden-size 512 --seq-length 4096 {sizes}"
    layer = layer_from_megatron(text, gpus)
    assert (layer.nodes, layer.ranks_per_node, layer.groups_per_node) == layout


@pytest.mark.parametrize(
    ("text", "gpus", "message"),
    [
        (
            "--seq-length 4096 --hidden-size 512 --context-parallel-size 2",
            8,
            "--num-attention-heads None must be given",
        ),
        (
            "--num-attention-heads 8 --hidden-size 512 --context-parallel-size 2",
            8,
            "--seq-length None must be given",
        ),
        (
            "--num-attention-heads 8 --seq-length 4096 --context-parallel-size 2",
            8,
            "--hidden-size (or --kv-channels) None must be given",
        ),
        (
            "--num-attention-heads 8 --hidden-size 500 --seq-length 4096 --context-parallel-size 2",
            8,
            "--hidden-size 500 is not divisible by --num-attention-heads 8",
        ),
        (
            "--num-attention-heads 8 --group-query-attention --num-query-groups 3 "
            "--hidden-size 512 --seq-length 4096 --context-parallel-size 2",
            8,
            "must be divisible by --num-query",
        ),
        (
            "--num-attention-heads 8 --hidden-size 512 --seq-length 4096",
            8,
            "--context-parallel-size is 1",
        ),
        (
            "--num-attention-heads 8 --hidden-size 512 --seq-length 4096 --context-parallel-size 2",
            None,
            "--megatron needs --gpus-per-node",
        ),
        (
            "--num-attention-heads 8 --hidden-size 512 --seq-length 4096 --context-parallel-size 2 "
            "--tensor-model-parallel-size 3",
            8,
            "--tensor-model-parallel-size 3 must divide",
        ),
        (
            "--num-attention-heads 8 --hidden-size 512 --seq-length 4096 --context-parallel-size 6",
            8,
            "--context-parallel-size 6 and a node's 8 CP ranks",
        ),
        ("--num-attention-heads eight --hidden-size 512 --seq-length 4096", 8, "cannot read it"),
        ("--num-attention-heads 8 --hidden-size 512 --seq-length '4096", 8, "cannot read it"),
    ],
)
def test_what_cannot_be_read_names_its_flag(text: str, gpus: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        layer_from_megatron(text, gpus)
    assert message in str(info.value)


def test_cli_megatron_is_the_same_prediction_as_its_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    via = run_json(capsys, ["--preset", "H100", "--gpus-per-node", "8", "--megatron", LLAMA])
    flags = run_json(capsys, ["--preset", "H100", *FLAGS])
    assert "CP 16 as 4 node(s) x 4 rank(s) (--gpus 4x4)" in via.pop("megatron")
    assert via.pop("current_cp_comm_type").startswith("your run's --cp-comm-type: p2p (ring")
    assert via == flags


def test_cli_prints_what_it_read(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--preset", "H100", "--gpus-per-node", "8", "--megatron", LLAMA]) == 0
    out = capsys.readouterr().out
    assert "  - from --megatron on 8 GPUs per node: CP 16 as 4 node(s) x 4 rank(s)" in out
    assert "32 heads (8 kv) of 128, 2 bytes per element, causal, TP 2" in out
    assert "not read" not in out


def test_query_groups_without_gqa_are_named_as_not_read(capsys: pytest.CaptureFixture) -> None:
    line = LLAMA.replace("--group-query-attention ", "")
    assert line != LLAMA
    layer = layer_from_megatron(line, 8)
    assert layer.kv_heads == layer.heads == 32
    assert len(layer.unread) == 1 and "--num-query-groups 8 without" in layer.unread[0]
    assert main(["advise", "--preset", "H100", "--gpus-per-node", "8", "--megatron", line]) == 0
    out = capsys.readouterr().out
    assert "32 heads (32 kv) of 128" in out
    assert "; not read: --num-query-groups 8 without --group-query-attention" in out
    # as many groups as heads, or Megatron's default left alone: nothing to say
    same = layer_from_megatron(line.replace("--num-query-groups 8", "--num-query-groups 32"), 8)
    assert same.unread == ()
    assert layer_from_megatron(line.replace("--num-query-groups 8", ""), 8).unread == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus-per-node", "8", "--megatron", LLAMA, "--heads", "8"], "--heads and --megatron"),
        (["--gpus-per-node", "8", "--megatron", LLAMA, "--causal"], "--causal and --megatron"),
        (["--gpus-per-node", "8", "--megatron", LLAMA, "--tp", "1"], "--tp and --megatron"),
        (["--gpus-per-node", "8", "--gpus", "2x8", "--heads", "8"], "pass --megatron too"),
        (["--gpus", "2x8", "--heads", "8"], "--seq, --head-dim missing"),
    ],
)
def test_cli_refuses_a_problem_given_twice_or_not_at_all(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["--preset", "H100", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_runs_own_cp_comm_type() -> None:
    assert layer_from_megatron(LLAMA, 8).cp_comm_types == ("p2p",)  # Megatron's default
    per_layer = layer_from_megatron(f"{LLAMA} --cp-comm-type p2p a2a p2p", 8)
    assert per_layer.cp_comm_types == ("p2p", "a2a")
    totals = {"ring": 0.09, "charm": 0.03, "a2a+p2p": 0.045}
    line = against_current(("p2p", "a2a+p2p"), totals, "charm")
    assert line == (
        "your run's --cp-comm-type: p2p (ring here) 90 ms forward+backward, charm 30 ms: 3.00x; "
        "a2a+p2p (a2a+p2p here) 45 ms forward+backward, charm 30 ms: 1.50x"
    )
    assert against_current(("charm",), totals, "charm") is None
    odd = against_current(("auto", "a2a", "ringg"), totals, "charm")
    assert odd is not None
    assert "auto picks per layer shape at run time" in odd
    assert "a2a cannot split this shape" in odd and "ringg is not a method we know" in odd


def test_cli_compares_the_runs_own_method(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "H100", "--gpus-per-node", "8", "--megatron"]
    data = run_json(capsys, [*argv, f"{LLAMA} --cp-comm-type a2a+p2p"])
    times = {
        m: sum(data["methods"][m][p]["time_ms"] for p in ("forward", "backward"))
        for m in ("a2a+p2p", "charm")
    }
    want = f"a2a+p2p (a2a+p2p here) {times['a2a+p2p']:.3g} ms forward+backward"
    assert want in data["current_cp_comm_type"]
    assert main(["advise", *argv, LLAMA]) == 0
    assert "  - your run's --cp-comm-type: p2p (ring here)" in capsys.readouterr().out
    # a run without --megatron has no such line
    assert "current_cp_comm_type" not in run_json(capsys, ["--preset", "H100", *FLAGS])
