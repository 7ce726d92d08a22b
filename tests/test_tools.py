"""The benchmarks' own arithmetic (their timings are never tested)."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kernel_calls
from jaxrlhf import make_mesh, reshard
from tools import common
from tools.bench_reshard import bytes_per_device, received_bytes

# An OPT preset small enough for a whole benchmark run in a test (the tools' --actor opt-tiny)
TINY_OPT = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_dim=64,
    word_embed_proj_dim=32,
    vocab_size=128,
    max_position_embeddings=64,
)


def test_received_bytes_counts_what_device_0_lacks():
    tree = {"decoder": {"embed_tokens": {"embedding": np.ones((64, 32), np.float32)}}}
    replicate = make_mesh(tp=1)  # generation layout replicated over data = 8
    fsdp = reshard(tree, "fsdp", replicate)
    assert received_bytes(fsdp, reshard(fsdp, "tp", replicate)) == 56 * 32 * 4  # has 8 of 64 rows
    assert bytes_per_device(fsdp) == 8 * 32 * 4
    aligned = make_mesh(tp=8)  # FSDP already holds exactly the tp shard
    fsdp = reshard(tree, "fsdp", aligned)
    assert received_bytes(fsdp, reshard(fsdp, "tp", aligned)) == 0
    two = make_mesh(tp=2)  # 8 rows held; the tp shard is 32 rows
    fsdp = reshard(tree, "fsdp", two)
    assert received_bytes(fsdp, reshard(fsdp, "tp", two)) == 24 * 32 * 4
    assert jax.device_count() == 8


def test_safely_and_the_child_process_report_errors_per_run():
    assert common.safely(lambda a, b: {"sum": a + b}, 2, 3) == {"sum": 5}
    assert common.safely(lambda: 1 / 0) == {"error": "division by zero"}
    assert common.torch_child(
        [
            "-c",
            "import os; print('noise'); "
            "print('{\"8\": ' + repr(os.environ['JAX_PLATFORMS']) .replace(\"'\", '\"') + '}')",
        ],
        [8],
    ) == {"8": "cpu"}
    failed = common.torch_child(["-c", "raise SystemExit('out of memory')"], [16, 64])
    assert failed == {k: {"error": "child process failed: out of memory"} for k in ("16", "64")}


def test_kernel_totals_sum_device_kernels_per_line_and_skip_the_host():
    meta = lambda pid, name, tid=None: {
        "ph": "M",
        "pid": pid,
        **({"tid": tid} if tid else {}),
        "name": "thread_name" if tid else "process_name",
        "args": {"name": name},
    }
    kernel = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": 0, "dur": dur}
    events = [
        meta(1, "/host:CPU"),
        meta(2, "/device:GPU:0"),
        meta(2, "Stream #14", tid=7),
        kernel(1, 3, "PjitFunction", 900.0),
        kernel(2, 7, "memcpy128", 12.5),
        kernel(2, 7, "gemm", 40.0),
        kernel(2, 7, "memcpy128", 13.5),
        kernel(2, 7, "tiny", 1.0),
    ]
    got = common.kernel_totals(events, top=2)
    assert got == {
        "/device:GPU:0 Stream #14": {
            "busy_ms": pytest.approx(0.067),
            "kernels": [
                {"name": "gemm", "count": 1, "total_ms": pytest.approx(0.04)},
                {"name": "memcpy128", "count": 2, "total_ms": pytest.approx(0.026)},
            ],
        }
    }


def test_kernel_totals_split_by_the_engines_phase_annotations():
    meta = lambda pid, name, tid=None: {
        "ph": "M",
        "pid": pid,
        **({"tid": tid} if tid else {}),
        "name": "thread_name" if tid else "process_name",
        "args": {"name": name},
    }
    event = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = [
        meta(1, "/host:CPU"),
        meta(2, "/device:GPU:0"),
        meta(2, "Stream #14", tid=7),
        event(1, 3, "jaxrlhf.generate", 0.0, 100.0),
        event(1, 3, "jaxrlhf.actor_step", 200.0, 100.0),
        event(2, 7, "decode", 10.0, 30.0),
        event(2, 7, "decode", 50.0, 30.0),
        event(2, 7, "gemm", 210.0, 50.0),
        event(2, 7, "copy", 150.0, 5.0),
    ]
    got = common.kernel_totals(events)
    line = "/device:GPU:0 Stream #14"
    assert got == {
        f"{line} [generate]": {
            "busy_ms": pytest.approx(0.06),
            "kernels": [{"name": "decode", "count": 2, "total_ms": pytest.approx(0.06)}],
        },
        f"{line} [actor_step]": {
            "busy_ms": pytest.approx(0.05),
            "kernels": [{"name": "gemm", "count": 1, "total_ms": pytest.approx(0.05)}],
        },
        f"{line} [other]": {
            "busy_ms": pytest.approx(0.005),
            "kernels": [{"name": "copy", "count": 1, "total_ms": pytest.approx(0.005)}],
        },
    }


@pytest.mark.slow
def test_tp_tokens_match_on_the_cpu_mesh():
    """bench_generate --check-tokens: TP 2 greedy tokens against one device, exact in float32 on the CPU."""
    from jaxrlhf import OPTConfig, init_params
    from tools.bench_generate import tp_tokens_match

    config = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dtype="bfloat16",
    )
    mesh = make_mesh(2, jax.devices()[:2])
    params = reshard(init_params(config, jax.random.key(0), std=0.5), "tp", mesh)
    result = tp_tokens_match(config, params, mesh, 4, 6, 8)
    assert result["float32"] == {"rows_equal": 1.0, "first_step_differing": None}
    assert set(result) == {"bfloat16", "float32"} and 0 <= result["bfloat16"]["rows_equal"] <= 1


@pytest.mark.slow
def test_tune_keeps_the_best_knobs_of_each_kinds_first_shape(monkeypatch):
    """Times at different shapes do not compare: the second multi-head shape's faster calls must not win."""
    from tools import bench_decode_attention as bench

    def fake(cfg, q, *rest):  # microseconds by shape (batch) and knobs: 32/4/2 best at batch 2, 64/2/3 at batch 1
        fast = (cfg.block_s, cfg.num_warps, cfg.num_stages) == ((32, 4, 2) if q.shape[0] == 2 else (64, 2, 3))
        return (1e-6 if fast else 2e-6) * (10 if q.shape[0] == 2 else 1) * (1 + cfg.num_splits) / 2

    monkeypatch.setattr(bench, "time_call", fake)
    result = {"tuning": []}
    best = bench.tune(None, result, [(2, 4, 4, 32, 16), (1, 4, 4, 32, 16), (2, 4, 2, 32, 16)], ragged=True)
    assert (best["mha"].block_s, best["mha"].num_warps, best["mha"].num_stages) == (32, 4, 2)
    assert (best["gqa"].block_s, best["gqa"].num_warps, best["gqa"].num_stages) == (32, 4, 2)
    # the sweep (product forms x 36 knob settings for multi-head, 36 for grouped-query) plus 2 and 4 splits per shape
    assert len(result["tuning"]) == 2 * 72 + 36 + 3 * 2


@pytest.mark.slow
def test_decode_matmul_bench_times_the_same_ffn_in_both_forms():
    """bench_decode_matmul: the kernel form and XLA's both equal OPT's pre-LN FFN by hand, and the kernel form runs
    fc1 and fc2 in the kernel in every layer of the chain it times."""
    import jax.numpy as jnp

    from jaxrlhf.models.common import fold_norm
    from tools import bench_decode_matmul as bench

    D, F, M = 256, 512, 16
    k = jax.random.split(jax.random.key(0), 7)
    normal = lambda i, shape, s=1.0: np.asarray(jax.random.normal(k[i], shape, jnp.float32)) * s
    w1, b1, w2, b2 = normal(0, (D, F), 0.1), normal(1, (F,), 0.1), normal(2, (F, D), 0.1), normal(3, (D,), 0.1)
    scale, shift, h = 1 + normal(4, (D,), 0.2), normal(5, (D,), 0.2), normal(6, (M, D)) + 0.5
    normed = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + bench.EPS) * scale + shift
    expected = h + np.maximum(normed @ w1 + b1, 0) @ w2 + b2
    layer = {
        "fc1": fold_norm({"kernel": jnp.asarray(w1), "bias": jnp.asarray(b1)}, jnp.asarray(scale), jnp.asarray(shift)),
        "fc2": {"kernel": jnp.asarray(w2), "bias": jnp.asarray(b2)},
    }
    for kernel in (True, False):
        got = bench.ffn(jnp.asarray(h), layer, kernel, interpret=True)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)
    assert bench.max_rel_err(jnp.asarray(h), layer, interpret=True) < 1e-5

    layers = bench.make_layers(jax.random.key(1), 2, D, F, jnp.float32)
    jaxpr = jax.make_jaxpr(bench.chain(True, 1, interpret=True))(jnp.asarray(h), layers)
    assert kernel_calls(jaxpr, "jaxrlhf_decode_matmul") == 2 * 2
    assert bench.layer_bytes(D, F) == 2 * D * F * 2


@pytest.mark.slow
def test_xla_reads_read_a_decode_steps_bytes_once():
    """bench_generate's XLA reads: one row sum per weight matrix and per layer's K and V, over exactly the slots so
    far (P + G/2), each sum right, and the bytes those reads cover."""
    from jaxrlhf import OPTConfig, init_params
    from jaxrlhf.generate import decode_params
    from tools.bench_generate import xla_read_time, xla_reads

    config = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dtype="bfloat16",
    )
    params = decode_params(config, init_params(config, jax.random.key(0), dtype=jnp.bfloat16))
    B, P, G, min_bytes = 3, 6, 4, 1024
    fn, nbytes = xla_reads(config, params, B, P, G, min_bytes)
    mats = [x for x in jax.tree.leaves(params) if x.nbytes >= min_bytes]
    sums = fn()
    assert 0 < len(mats) < len(jax.tree.leaves(params)) and len(sums) == len(mats) + 2 * 2
    for x, got in zip(mats, sums):
        np.testing.assert_allclose(
            got, np.asarray(x, np.float32).reshape(-1, x.shape[-1]).sum(-1), rtol=1e-5, atol=1e-5
        )
    # the K and V reads: per layer K then V, a row per (row, head) of P + G/2 slots of 8 dims; the caches are
    # xla_reads' own, drawn from key 4
    want = [
        np.asarray(
            jax.random.normal(jax.random.fold_in(jax.random.key(4), i), (B * 4, (P + G // 2) * 8), jnp.bfloat16),
            np.float32,
        ).sum(-1)
        for i in range(2 * 2)
    ]
    for w, got in zip(want, sums[len(mats) :], strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    assert nbytes == sum(x.nbytes for x in mats) + 2 * 2 * B * 4 * (P + G // 2) * 8 * 2
    assert xla_read_time(config, params, B, P, G) == {
        "ms": None,
        "bytes": xla_reads(config, params, B, P, G)[1],
        "launches": 0,
        "kernels": [],
    }


def test_time_read_reads_the_given_bytes_once_per_call(monkeypatch):
    """bench_decode_attention.time_read: `calls` row sums of a [rows, row_bytes / 2] bf16 array (key 5), each call
    depending on the last, timed per call."""
    from tools import bench_decode_attention as bench

    out = {}

    def fake_timeit(fn, repeats, warmup):
        out["sums"] = fn()
        return {"median_s": 6.0}

    monkeypatch.setattr(bench.common, "timeit", fake_timeit)
    assert bench.time_read(3, 2 * 40, calls=2) == 3.0  # seconds per call
    a = np.asarray(jax.random.normal(jax.random.key(5), (3, 40), jnp.bfloat16), np.float32)
    np.testing.assert_allclose(out["sums"], 2 * a.sum(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_real_length_draws_and_both_sides_forcing_them(tmp_path):
    """bench_ppo --lengths: the draws drop long prompts and cap answers; the prompts carry exactly the drawn real
    tokens; HF's generate with the length forcer and ours with answer_limits end every row at its drawn length."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import make_hf_opt
    from jaxrlhf import load_hf
    from jaxrlhf.generate import generate
    from tools.bench_ppo import draw_lengths, length_forcer, prompt_batch

    file = tmp_path / "lengths.json"
    file.write_text(json.dumps({"pairs": [[5, 3], [9, 2], [4, 30], [2, 1]]}))
    prompts, answers = draw_lengths(str(file), 64, max_prompt=6, max_answer=7)
    assert set(prompts) == {5, 4, 2} and set(answers) == {3, 7, 1}  # [9, 2] dropped, 30 capped at 7
    batch = prompt_batch(64, 6, prompts, answers, vocab=50)
    np.testing.assert_array_equal(batch["prompt_mask"].sum(1), prompts)
    assert (batch["prompt_ids"][np.arange(64), 6 - prompts] == 2).all()  # BOS first
    assert (batch["prompt_ids"][batch["prompt_mask"] == 0] == 1).all()

    folder = make_hf_opt(tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask, limits = (
        torch.tensor(batch[k][:8], dtype=torch.long) for k in ("prompt_ids", "prompt_mask", "answer_limits")
    )
    seq = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=7,
        do_sample=True,
        eos_token_id=2,
        pad_token_id=1,
        logits_processor=[length_forcer(6, limits, 2)],
    )
    answer = seq[:, 6:].numpy()
    for row, n in enumerate(limits.numpy()):
        assert (answer[row, : n - 1] != 2).all() and answer[row, n - 1] == 2 and (answer[row, n:] == 1).all()
    config, params = load_hf(folder)
    ours = generate(
        config,
        params,
        batch["prompt_ids"][:8],
        batch["prompt_mask"][:8],
        jax.random.key(0),
        max_new_tokens=7,
        eos_id=-1,
        limits=batch["answer_limits"][:8],
    )
    np.testing.assert_array_equal(np.asarray(ours.mask).sum(1), batch["answer_limits"][:8])


def test_bench_summary_reads_the_latest_unlabelled_result_of_each_benchmark(tmp_path):
    """tools/bench_summary.py: one row per benchmark and name, from its newest file without a label."""
    from tools import bench_summary

    results, readme = tmp_path / "results", tmp_path / "README.md"
    (results / "ppo").mkdir(parents=True)
    (results / "generate").mkdir()
    ppo_run = lambda ours, peer: {
        "batch": 768,
        "ours_pure_bf16": {"samples_per_s": ours, "real_tokens_per_s": 16763.8},
        "torch_hf_pure_bf16": {"samples_per_s": peer},
    }
    env = {"device": "NVIDIA H200", "device_count": 1}
    for name, ours, date in [
        ("ppo-opt-1.3b-lengths-20261203-063407", 61.6, "2026-12-03T06:34"),
        ("ppo-opt-1.3b-lengths-20261203-072331", 125.4, "2026-12-03T07:23"),
        ("ppo-opt-1.3b-lengths-20261203-080000-profile", 99.0, "2026-12-03T08:00"),
    ]:
        (results / "ppo" / f"{name}.json").write_text(json.dumps({**env, "date": date, "runs": [ppo_run(ours, 38.7)]}))
    generate = {
        "device": "NVIDIA H200",
        "device_count": 2,
        "date": "2026-12-03T06:29:11+00:00",
        "runs": [
            {
                "batch": 64,
                "ours": {"ms_per_step": 2.4630, "roofline_fraction": 0.68},
                "hf_static": {"ms_per_step": 5.33},
            }
        ],
    }
    (results / "generate" / "generate-opt-1.3b-20261203-062911.json").write_text(json.dumps(generate))
    (results / "generate" / "generate-llama-7b-gqa-20261202-173044.json").write_text(json.dumps({"runs": "old"}))

    text = bench_summary.table(results, tmp_path)
    rows = text.splitlines()[2:]
    assert len(rows) == 3
    assert rows[0].startswith("| generate | generate-llama-7b-gqa | (not read: AttributeError")
    assert rows[1] == (
        "| generate | generate-opt-1.3b | B=64: 2.46 ms/step (1.47× roofline); HF static 5.33 | "
        "2 × NVIDIA H200 | 2026-12-03 | [generate-opt-1.3b-20261203-062911.json]"
        "(results/generate/generate-opt-1.3b-20261203-062911.json) |"
    )
    assert rows[2] == (
        "| ppo | ppo-opt-1.3b-lengths | B=768: 125.4 samples/s, 16,764 real tokens/s; PyTorch+HF 38.7 "
        "(3.24×) | NVIDIA H200 | 2026-12-03 | [ppo-opt-1.3b-lengths-20261203-072331.json]"
        "(results/ppo/ppo-opt-1.3b-lengths-20261203-072331.json) |"
    )

    readme.write_text(
        "# bench\n\nintro\n\n" + bench_summary.START + "\nold table\n" + bench_summary.END + "\n\nafter\n"
    )
    updated = bench_summary.update(readme, text)
    assert updated.startswith("# bench\n\nintro\n\n") and updated.endswith("\n\nafter\n")
    assert "old table" not in updated and text in updated
    assert bench_summary.update(tmp_path / "none.md", "T") == f"{bench_summary.START}\nT\n{bench_summary.END}\n"


@pytest.mark.slow
def test_bench_ppo_grpo_counts_answers_and_records_the_algorithm(tmp_path, monkeypatch, capsys):
    """bench_ppo --algorithm ppo grpo --samples-per-prompt 4: --batch counts answers (B / n prompts, n answers each,
    every answer its own drawn length: the same answer tokens as PPO's run), one result file per algorithm and n, the
    algorithm and n in every run's record; the PyTorch peer's GRPO iteration runs (in process here, not in a child)."""
    from jaxrlhf.models import opt
    from tools import bench_ppo as bench

    tiny = TINY_OPT
    monkeypatch.setitem(opt.PRESETS, "opt-tiny", tiny)
    monkeypatch.setitem(bench.PRESETS, "opt-tiny", tiny)
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"pairs": [[5, 3], [7, 2], [4, 6], [2, 1], [6, 5]]}))
    B, n = 8, 4
    prompts, answers = bench.draw_lengths(str(lengths), B, 8, 6)
    assert len(set(answers[:n])) > 1  # a group's answers differ in length: each answer draws its own

    def child(argv, keys):  # common.torch_child, in this process (the tiny preset exists only here)
        assert argv[argv.index("--algorithm") + 1 : argv.index("--algorithm") + 2] == ["grpo"]
        monkeypatch.setattr(sys, "argv", argv)
        bench.main()
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert set(got) == set(keys) == {f"grpo-n{n}-{B}"}
        return got

    monkeypatch.setattr(bench.common, "torch_child", child)
    common_args = [
        "--actor",
        "opt-tiny",
        "--critic",
        "opt-tiny",
        "--batch",
        str(B),
        "--prompt",
        "8",
        "--new",
        "6",
        "--precision",
        "fp32",
        "--repeats",
        "1",
        "--micro-batch",
        str(B),
        "--torch-micro-batch",
        "4",
        "--lengths",
        str(lengths),
        "--out",
        str(tmp_path / "out"),
    ]
    monkeypatch.setattr(
        sys, "argv", ["bench_ppo.py", *common_args, "--algorithm", "grpo", "--samples-per-prompt", str(n)]
    )
    bench.main()
    monkeypatch.setattr(sys, "argv", ["bench_ppo.py", *common_args, "--algorithm", "ppo", "--no-torch"])
    bench.main()
    files = {p.name.rsplit("-", 2)[0]: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert set(files) == {"grpo-n4-opt-tiny-lengths", "ppo-opt-tiny-lengths"}
    grpo, ppo = files["grpo-n4-opt-tiny-lengths"], files["ppo-opt-tiny-lengths"]
    assert (grpo["algorithm"], grpo["samples_per_prompt"], ppo["algorithm"], ppo["samples_per_prompt"]) == (
        "grpo",
        n,
        "ppo",
        1,
    )
    (g,), (p,) = grpo["runs"], ppo["runs"]
    assert (g["batch"], g["prompts"], p["batch"], p["prompts"]) == (B, B // n, B, B)
    # the real tokens: every answer's own prompt (the group's: every n-th draw) and its own drawn answer length
    real = int(n * prompts[::n].sum() + answers.sum())
    for side in ("ours_fp32", "torch_hf_pure_bf16"):
        r = g[side]
        assert (r["algorithm"], r["samples_per_prompt"], r["prompts"], r["answers"]) == ("grpo", n, B // n, B), side
        assert r["real_tokens"] == real and r["samples_per_s"] == pytest.approx(B / r["iteration_s"])
    assert (
        g["ours_fp32"]["answer_tokens"] == p["ours_fp32"]["answer_tokens"] == answers.sum()
    )  # lengths forced per answer
    assert g["ours_fp32"]["phases_s"]["critic_step"] == 0 and p["ours_fp32"]["phases_s"]["critic_step"] > 0
    # packed micro-batches hold no more padding than the padded block of 8 + 6 positions a row
    assert real / (B * 14) <= g["ours_fp32"]["micro_batch_real_share"] <= 1
    assert "torch_hf_pure_bf16" not in p
    assert g["effective_flops"] < p["effective_flops"]  # no critic forward or update
    compiled = g["ours_fp32"]["first_iteration_compiles"]  # the process's first engine: its programs were compiled
    assert compiled["programs"] >= sum(n for n, _ in compiled["by_function"].values()) > 0
    assert {"jit(_generate)", "jit(accumulate)"} <= set(compiled["by_function"]), compiled
    assert g["ours_fp32"]["later_compiles"] == p["ours_fp32"]["later_compiles"] == 0  # timed iterations compile nothing


def test_logprob_gap_compares_generation_and_two_training_forwards_per_answer_token(tmp_path, monkeypatch):
    """bench_logprob_gap: the statistics of a hand-made case; on a tiny OPT in float32, generation's log-probs and two
    training forwards (the engine's packed scoring, padded micro-batches) of the same answers agree to rounding, over
    exactly the drawn answer tokens; the JSON lands under --out."""
    from jaxrlhf.models import opt
    from tools import bench_logprob_gap as bench

    got = bench.gap(np.array([[0.0, 0.1], [0.3, 9.0]]), np.zeros((2, 2)), np.array([[1, 1], [1, 0]]))
    assert got["tokens"] == 3 and got["max_abs"] == pytest.approx(0.3) and got["mean"] == pytest.approx(0.4 / 3)
    assert got["mean_abs"] == pytest.approx(0.4 / 3) and got["outside_clip"] == pytest.approx(1 / 3)  # e^0.3 - 1 > 0.2
    tiny = TINY_OPT
    monkeypatch.setitem(opt.PRESETS, "opt-tiny", tiny)
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"pairs": [[5, 3], [7, 2], [4, 6], [2, 1], [6, 5]]}))
    args = ["--actor", "opt-tiny", "--critic", "opt-tiny", "--batch", "8", "--prompt", "8", "--new", "6"]
    args += ["--lengths", str(lengths), "--precision", "fp32", "--micro", "4", "--tokens", "64"]
    path = bench.main([*args, "--out", str(tmp_path / "out")])
    run = json.loads(path.read_text())["runs"]["fp32"]
    _, answers = bench.draw_lengths(str(lengths), 8, 8, 6)
    assert run["answer_tokens"] == answers.sum() and path.parent == tmp_path / "out"
    for pair in ("generation_vs_training", "generation_vs_training_padded", "training_vs_training"):
        assert run[pair]["tokens"] == answers.sum() and run[pair]["max_abs"] < 1e-4, pair
    assert -6 < run["mean_logprob"] < -4  # near log(1 / 128): random weights, the drawn tokens' real log-probs


def test_hlo_census_counts_each_instructions_op_kind_and_lists_every_difference():
    """tools/hlo_census.py: an instruction's op kind after its name and shape (a tuple shape included), header lines
    none; a compiled function's census holds its ops; compare lists each changed count and each one-sided program."""
    from tools.hlo_census import census, compare, op_kind

    assert op_kind("  %fusion.1 = f32[2,3]{1,0} fusion(f32[2,3]{1,0} %p), kind=kLoop, calls=%fused") == "fusion"
    assert op_kind("  ROOT %t.5 = (f32[2]{0}, s32[]) tuple(f32[2]{0} %a, s32[] %b)") == "tuple"
    assert op_kind("  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t), condition=%c, body=%b") == "while"
    assert op_kind('  %c.2 = s32[] custom-call(s32[] %x), custom_call_target="f"') == "custom-call"
    assert op_kind("HloModule jit_f, entry_computation_layout={(f32[3]{0})->f32[3]{0}}") is None
    assert op_kind("ENTRY %main.4 (x: f32[3]) -> f32[3] {") is None
    counts = census(lambda x: jnp.sin(x) * jnp.cos(x), jnp.ones(3))
    assert counts.get("sine") == 1 and counts.get("cosine") == 1, counts
    before = {"opt": {"train": {"add": 2, "dot": 1}, "score": {"dot": 1}}}
    after = {"opt": {"train": {"add": 3, "dot": 1}, "prefill": {"dot": 1}}}
    assert compare(before, before) == []
    assert compare(before, after) == ["opt/prefill: only after", "opt/score: only before", "opt/train: add 2 -> 3"]
