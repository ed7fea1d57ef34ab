"""bench/real_shape.py: its --smoke run on the CPU (the GPU benchmark's code path on a tiny config) writes the
JSON and markdown report, with finite step times and floors per batch and the 64-layer memory report; and its
kernel -> engine scope mapping on synthetic trace events and HLO text."""

import argparse
import importlib.util
import json
import math
import os
import sys

import child
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "real_shape.py")


def qwen35_27b_params():
    """Parameters of the 64-layer Qwen3.5-27B text model, counted here from its published dimensions."""
    d, inter, vocab, layers = 5120, 17408, 248320, 64
    hq, kvh, hd = 24, 4, 256  # gated attention: q_proj has 2 x hq x hd outputs (q, gate)
    hk, hv, dk, dv, w = 16, 48, 128, 128, 4  # Gated DeltaNet
    mlp = 3 * d * inter
    norms = 2 * d
    conv = 2 * hk * dk + hv * dv
    gdn = d * conv + d * hv * dv + 2 * d * hv + conv * w + 2 * hv + dv + hv * dv * d
    attn = d * 2 * hq * hd + 2 * d * kvh * hd + hq * hd * d + 2 * hd
    n_attn = layers // 4
    return vocab * d * 2 + d + n_attn * (attn + mlp + norms) + (layers - n_attn) * (gdn + mlp + norms)


def qwen35_35b_a3b_params():
    """(all, routed experts) parameters of the 40-layer Qwen3.5-35B-A3B text model, from its published
    dimensions: every layer 256 experts of width 512, a shared expert of 512 with its gate, a router."""
    d, vocab, layers, experts, width = 2048, 248320, 40, 256, 512
    hq, kvh, hd = 16, 2, 256
    hk, hv, dk, dv, w = 16, 32, 128, 128, 4
    routed = experts * 3 * d * width
    moe = routed + 3 * d * width + d + d * experts  # + shared expert, its gate, the router
    norms = 2 * d
    conv = 2 * hk * dk + hv * dv
    gdn = d * conv + d * hv * dv + 2 * d * hv + conv * w + 2 * hv + dv + hv * dv * d
    attn = d * 2 * hq * hd + 2 * d * kvh * hd + hq * hd * d + 2 * hd
    n_attn = layers // 4
    total = vocab * d * 2 + d + n_attn * (attn + moe + norms) + (layers - n_attn) * (gdn + moe + norms)
    return total, layers * routed


def test_moe_floors_count_the_experts_a_step_hits():
    """The 35B-A3B's weight floor: every non-expert weight, plus the routed experts that `tokens` tokens
    hit in expectation (1 - (1 - 8/256)^tokens of them), growing with the tokens to all of them."""
    rs = _bench_module()
    from jaxspec.bench import shapes

    tshape, dshape = shapes.shapes_of("qwen3.5-35b-a3b")
    tc = shapes.target_config(tshape, tshape["layers"])
    pb = rs.param_bytes(tc, None)
    total, routed = qwen35_35b_a3b_params()
    assert pb["routed_experts"] == 2 * routed
    body = pb["target_layers"] + pb["embed"] + pb["lm_head"] + pb["target_norm"]
    assert abs(body - 2 * total) <= 0.01 * 2 * total, (body, 2 * total)
    assert 33e9 < total < 36e9  # the count itself: a 35B model
    assert rs.expert_share(tc, 1) == 8 / 256
    cache_cfg = rs.spec_config("none", 1, argparse.Namespace(max_len=1024, num_tiers=4)).cache_config(8, "bfloat16")
    weights = []
    for tokens in (1, 8, 64, 512):
        floor = rs.step_floor(tc, None, cache_cfg, batch=1, tokens=tokens, ctx=0, bandwidth=1e12)
        share = 1 - (1 - 8 / 256) ** tokens
        want = pb["target_layers"] - pb["routed_experts"] * (1 - share) + pb["target_norm"] + pb["lm_head"]
        assert abs(floor["terms"]["weights"] - tokens * tc.hidden_size * 2 - want) <= 1
        weights.append(floor["terms"]["weights"])
    assert weights == sorted(weights) and weights[-1] < body
    dense = shapes.target_config(shapes.shapes_of("qwen3.5-27b")[0], 16)
    assert rs.expert_share(dense, 64) == 0.0


def test_compute_floor_counts_each_token_through_the_weights():
    """step_flops: 2 FLOPs per weight per token through the target (27B: all but the embedding; the
    35B-A3B: only its top-8 routed experts of 256, ~3B active), the draft's block rows through the draft
    and its block - 1 rows through the lm_head, and attention growing with the context."""
    rs = _bench_module()
    from jaxspec.bench import shapes

    tshape, dshape = shapes.shapes_of("qwen3.5-27b")
    tc = shapes.target_config(tshape, tshape["layers"])
    dc = shapes.draft_config(dshape, tc, 8)
    total = qwen35_27b_params()
    embed = tc.vocab_size * tc.hidden_size
    none = rs.step_flops(tc, None, batch=4, tokens=4, ctx=0)
    assert set(none["terms"]) == {"target_products", "attention", "gdn"}
    assert abs(none["terms"]["target_products"] - 2 * 4 * (total - embed)) <= 0.01 * 2 * 4 * total
    spec = rs.step_flops(tc, dc, batch=4, tokens=32, ctx=0)
    assert spec["terms"]["target_products"] == pytest.approx(8 * none["terms"]["target_products"])
    assert spec["terms"]["draft_lm_head"] == 2 * 4 * 7 * embed  # the lm_head is [hidden, vocab] like the embedding
    longer = rs.step_flops(tc, dc, batch=4, tokens=32, ctx=4096)
    assert longer["terms"]["attention"] > spec["terms"]["attention"] and longer["flops"] > spec["flops"]
    assert spec["flops"] == sum(spec["terms"].values())
    moe = shapes.target_config(shapes.shapes_of("qwen3.5-35b-a3b")[0], 40)
    active = rs.step_flops(moe, None, batch=1, tokens=1, ctx=0)["terms"]["target_products"] / 2
    assert 2.5e9 < active < 4e9, active  # A3B: ~3B parameters a token


@pytest.mark.parametrize(
    "model,layers,params,billions",
    [
        ("qwen3.5-27b", 64, qwen35_27b_params, (25, 29)),
        ("qwen3.5-35b-a3b", 40, lambda: qwen35_35b_a3b_params()[0], (33, 36)),
    ],
    ids=["dense-27b", "moe-35b-a3b"],
)
def test_smoke_run_writes_report(tmp_path, model, layers, params, billions):
    child.run_smoke("real_shape.py", "--smoke", "--model", model, "--out", str(tmp_path), timeout=600)

    report = json.loads((tmp_path / "real_shape.json").read_text())
    assert report["smoke"] and report["backend"] == "cpu"
    rows = {r["batch"]: r for r in report["rows"]}
    assert sorted(rows) == [1, 2]
    for b, row in rows.items():
        for key in ("none", "spec_full"):
            res = row[key]
            assert res is not None, (b, key, report["notes"])
            assert math.isfinite(res["ms"]) and res["ms"] > 0
            assert math.isfinite(res["floor_ms"]) and res["floor_ms"] > 0
            assert all(v > 0 for v in res["floor_terms_bytes"].values())
            assert res["compute_floor_ms"] > 0 and all(v > 0 for v in res["compute_terms_flops"].values())
            assert res["bound_ratio"] == pytest.approx(res["ms"] / max(res["floor_ms"], res["compute_floor_ms"]))
            assert res["gpu"] is None  # no GPU kernels in a CPU trace: no breakdown
            check = res["cpu_mapping_check"]  # the kernel -> scope mapping on XLA:CPU thunks
            assert check and check["by_scope"].get("verify", 0) > 0 and "hlo_op" in check["stats"]
        assert rows[b]["none"]["tokens_per_step"] == b  # one token a row
        assert rows[b]["spec_full"]["tokens_per_step"] == b * report["draft"]["block"]
        assert {"draft", "verify", "commit"} <= set(rows[b]["spec_full"]["cpu_mapping_check"]["by_scope"])
        assert not any("gumbel" in k["path"] for k in rows[b]["spec_full"]["cpu_mapping_check"]["kernels"])
        assert row["compact"], row  # the tiers below the full block
        for tier, res in row["compact"].items():
            assert res["ms"] > 0 and res["tokens_per_step"] == int(tier)  # forced acceptance: tier tokens

    mem = report["memory"]
    assert mem["layers"] == layers and mem["batch"] == 64 and mem["context"] == 8192
    expected = 2 * params()
    assert abs(mem["items"]["target weights"] - expected) <= 0.05 * expected, (mem["items"], expected)
    assert billions[0] * 1e9 < expected / 2 < billions[1] * 1e9  # the count itself
    assert mem["total"] == sum(mem["items"].values()) and mem["fits"] == (mem["total"] <= 141e9)

    md = (tmp_path / "real_shape.md").read_text()
    assert "| batch | none ms | none floor ms |" in md
    table = md[md.index("| batch | none ms") :].splitlines()
    assert [ln.split("|")[1].strip() for ln in table[2:4]] == ["1", "2"]
    assert f"## memory at {layers} layers" in md
    assert report["gemm_TFLOP_per_s"] > 0 and "| compute floor ms none / spec |" in md


def test_smoke_sampled_times_the_sampling_step(tmp_path):
    """--sampled: the timed spec step is the sampling variant (draws drafts: Gumbel noise in the draft scope)."""
    child.run_smoke(
        "real_shape.py", "--smoke", "--sampled", "--modes", "spec", "--tiers", "-1", "--out", str(tmp_path), timeout=600
    )
    report = json.loads((tmp_path / "real_shape.json").read_text())
    assert report["args"]["sampled"]
    for row in report["rows"]:
        kernels = row["spec_full"]["cpu_mapping_check"]["kernels"]
        assert any("draft/" in k["path"] and "gumbel" in k["path"] for k in kernels), kernels
    assert "sampling steps" in (tmp_path / "real_shape.md").read_text()


def test_smoke_compile_only(tmp_path):
    """--compile-only: abstract models and states (no concrete leaf, no live array), each batch's programs
    lowered and compiled with positive seconds (pass 1: the none prefill and step, then the spec prefill and
    the static step; pass 2: the compact steps below the full tier), totals per batch and overall, and no step
    timed (no timing rows, no floors, no copy bandwidth)."""
    child.run_smoke("real_shape.py", "--smoke", "--compile-only", "--out", str(tmp_path), timeout=300)

    report = json.loads((tmp_path / "real_shape.json").read_text())
    assert report["smoke"] and report["compile_only"] and report["backend"] == "cpu"
    assert report["concrete_leaves"] == 0  # models and engine states: jax.ShapeDtypeStruct leaves only
    assert report["live_array_bytes"] < sum(report["target"]["params"].values())  # no weights ever on the device
    assert "copy_TB_per_s" not in report and "floor_bandwidth" not in report
    rows = {r["batch"]: r for r in report["rows"]}
    assert sorted(rows) == [1, 2]
    for b, row in rows.items():
        assert row["none"] is None and row["spec_full"] is None and row["compact"] == {}, row  # nothing timed
        groups = {g["group"]: g for g in report["compiles"] if g["batch"] == b}
        assert sorted(groups) == ["pass 1 none", "pass 1 static", "pass 2"]  # one engine's state at a time
        first = {**groups["pass 1 none"]["programs"], **groups["pass 1 static"]["programs"]}
        assert sorted(first) == ["none prefill", "none step", "spec prefill", "static step"]
        compact = {k: v for k, v in groups["pass 2"]["programs"].items() if k.startswith("compact step ")}
        assert sorted(int(k.split()[-1]) for k in compact) == row["ladder"][:-1]  # the tiers below the full
        for name, prog in [*first.items(), *compact.items()]:
            assert "error" not in prog, (b, name, prog)
            assert prog["lower_s"] > 0 and prog["compile_s"] > 0, (b, name, prog)
        tot = report["compile_totals"]["by_batch"][str(b)]
        assert tot["programs"] == len(first) + len(groups["pass 2"]["programs"]) and tot["errors"] == 0
        assert tot["compile_s"] >= sum(p["compile_s"] for p in [*first.values(), *compact.values()]) > 0
    totals = report["compile_totals"]
    assert totals["programs"] == sum(t["programs"] for t in totals["by_batch"].values())
    assert math.isclose(totals["lower_s"], sum(t["lower_s"] for t in totals["by_batch"].values()))

    md = (tmp_path / "real_shape.md").read_text()
    assert "| batch | group | program | lower s | compile s |" in md and "| 2 | total |" in md
    assert "overall: " in md and "| batch | none ms" not in md  # no steps table


def _bench_module():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location("real_shape", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HLO = """HloModule jit__step, is_scheduled=true

%fused_computation.1 (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %sine.0 = f32[8]{0} sine(%param_0), metadata={op_name="jit(_step)/draft_context/sin"}
}

ENTRY %main.9 (p.1: f32[8]) -> f32[8] {
  %p.1 = f32[8]{0} parameter(0), metadata={op_name="state"}
  %loop_fusion.3 = f32[8]{0} fusion(%p.1), kind=kLoop, calls=%fused_computation.1
  %copy.7 = f32[8]{0} copy(%loop_fusion.3)
  %custom-call.2 = f32[8]{0} custom-call(%copy.7), custom_call_target="mosaic_gpu", metadata={op_name="jit(_step)/verify/pallas_call"}
  ROOT %gemm_fusion_dot.4 = f32[8]{0} fusion(%custom-call.2), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(_step)/jit(main)/accept/dot_general"}
}
"""


def test_kernel_scope_mapping():
    rs = _bench_module()
    scopes = rs.hlo_scopes(HLO)
    assert scopes["custom-call.2"] == ("verify", "metadata")
    assert scopes["loop_fusion.3"] == ("draft_context", "called")
    assert scopes["copy.7"][0] in ("draft_context", "verify") and scopes["copy.7"][1] == "neighbour"
    us = 1000
    events = [  # (start ns, duration ns, kernel name, stats, line)
        (0, 5 * us, "ampere_gemm", {"tf_op": "jit(_step)/draft/dot_general", "hlo_op": "dot.1"}, "Stream #1"),
        # XLA:GPU's tf_op on every kernel: the module, no op path; the HLO metadata gives it
        (10 * us, 3 * us, "verify_kernel", {"hlo_op": "custom-call.2", "tf_op": "XlaModule:"}, "Stream #1"),
        (20 * us, 2 * us, "loop_fusion_3", {}, "Stream #1"),  # no stats: the kernel name
        (30 * us, 1 * us, "mystery", {"hlo_op": "nowhere.1"}, "Stream #1"),
        (40 * us, 4 * us, "memcpy DtoD", {}, "Stream #2"),
        # inside a CUDA graph: the annotation names the graph, whatever op launched the kernel
        (50 * us, 6 * us, "nvjet_gemm", {"hlo_op": "command_buffer_1", "tf_op": "jit(_step)/draft/x"}, "Stream #1"),
    ]
    out = rs.map_events(events, 1, lambda: HLO)
    assert out["by_scope"] == {
        "draft": 5e-3,
        "verify": 3e-3,
        "draft_context": 2e-3,
        "command_buffer": 6e-3,
        "other": 1e-3,
    }
    assert out["busy_ms"] == 17e-3 and out["memcpy_ms"] == 4e-3
    assert out["by_source"] == {
        "stat:tf_op": 1,
        "hlo_op:metadata": 1,
        "kernel_name:called": 1,
        "unmapped": 1,
        "command_buffer": 1,
    }
    assert [u["kernel"] for u in out["unmapped"]] == ["mystery"] and out["unmapped_ms"] == 1e-3
    assert "hlo_op" in out["stats"] and out["by_kernel"][0]["kernel"] == "nvjet_gemm"  # the longest
    # every kernel, by time, with the jax op it runs: from its stats, else the HLO metadata of its op
    assert [(k["kernel"], k["path"]) for k in out["kernels"]] == [
        ("nvjet_gemm", "jit(_step)/draft/x"),
        ("ampere_gemm", "jit(_step)/draft/dot_general"),
        ("verify_kernel", "jit(_step)/verify/pallas_call"),
        ("loop_fusion_3", ""),
        ("mystery", ""),
    ]
    assert sum(k["ms"] for k in out["kernels"]) == pytest.approx(out["busy_ms"])
    assert rs.map_events([], 1, lambda: HLO) is None


def test_busy_time_is_the_union_of_kernel_intervals():
    """Overlapping kernels (a CUDA graph's concurrent nodes) count once; gaps do not count; order
    of the events does not matter."""
    from jaxspec.bench.trace import busy_ns

    events = [(0, 10, "a"), (5, 10, "b"), (30, 5, "c"), (31, 2, "d"), (20, 1, "e"), (34, 6, "f")]
    assert busy_ns(events) == 15 + 1 + 10  # [0, 15) + [20, 21) + [30, 40)
    assert busy_ns(events[::-1]) == 26
    assert busy_ns([]) == 0
    assert busy_ns([(7, 0, "empty"), (7, 3, "g")]) == 3
    assert sum(e[1] for e in events) == 34  # what a plain sum would have said
