"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers). record
is the newest GPU record of bench_attention.py; the tiny GPT's (train_tiny_gpt.py), the serving
benchmark's (bench_paged.py) and the generator's (generate_paged.py) are read here from their own
files.
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import results  # noqa: E402

# This chapter's targets against sdpa_flash (FlashAttention 2 inside PyTorch), per configuration.
FORWARD_RUNGS = ("mma", "pipelined", "tuned", "split_kv")
BACKWARD_RUNGS = ("mma", "mma_dqpass")


def _where(record):
    return f"{record['device']['name']}, {record['date'][:10]}, commit `{record['commit'][:12]}`"


def _sweep(record, **match):
    return {(r["seqlen"]): r for r in results.rows(record, op="attention", **match)}


def target_ratio(pass_, head_dim, causal, seqlen):
    if pass_ == "backward":
        return 0.8
    return 1.0 if head_dim == 128 and not causal and seqlen >= 4096 else 0.9


def target_table(record):
    """Per pass, head dim and mask (bfloat16): the best rung's TFLOP/s and its ratio to
    sdpa_flash at the shortest and the longest seqlen, against this chapter's target."""
    lines = ["| pass | d | causal | rung | TFLOP/s (s = 512 / 16384) | x sdpa_flash | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for pass_, rungs in (("forward", FORWARD_RUNGS), ("backward", BACKWARD_RUNGS)):
        for d in (64, 128):
            for causal in (False, True):
                base = _sweep(record, variant="sdpa_flash", dtype="bfloat16", head_dim=d, causal=causal,
                              **{"pass": pass_})
                best, best_ratio = None, None
                for v in rungs:
                    ours = _sweep(record, variant=v, dtype="bfloat16", head_dim=d, causal=causal, **{"pass": pass_})
                    ratios = {s: base[s]["median_ms"] / ours[s]["median_ms"] for s in ours if s in base}
                    if ratios and (best_ratio is None or min(ratios.values()) > min(best_ratio.values())):
                        best, best_ratio = (v, ours), ratios
                if best is None:
                    continue
                v, ours = best
                lo, hi = min(ours), max(ours)
                met = all(r >= target_ratio(pass_, d, causal, s) for s, r in best_ratio.items())
                target = ("1.0x at s >= 4096, 0.9x below" if pass_ == "forward" and d == 128 and not causal
                          else f"{target_ratio(pass_, d, causal, 512)}x")
                lines.append(f"| {pass_} | {d} | {causal} | {v} | {ours[lo]['TFLOPs']:.0f} / {ours[hi]['TFLOPs']:.0f} "
                             f"(sdpa_flash {base[lo]['TFLOPs']:.0f} / {base[hi]['TFLOPs']:.0f}) | "
                             f"{best_ratio[lo]:.2f} / {best_ratio[hi]:.2f} | {target} | "
                             f"{'yes' if met else 'no'} |")
    mm = record["ceilings"]["mm_TFLOPs"]
    lines += ["", f"{_where(record)}; bfloat16 matmul measured in the same run: {mm:.0f} TFLOP/s."]
    return "\n".join(lines)


def split_kv_table(record):
    """Per (query rows, keys): split_kv's GB/s and % of copy, tuned's (the same kernel unsplit),
    and split_kv's speed against sdpa_flash."""
    rows = results.rows(record, op="attention_split_kv")
    if not rows:
        return "(not measured)"
    lines = ["| s_q | s_k | split_kv GB/s (% of copy) | tuned (% of copy) | sdpa_flash (% of copy) | "
             "split_kv x sdpa_flash |", "|---|---|---|---|---|---|"]
    for n_q, n_k in dict.fromkeys((r["seqlen_q"], r["seqlen_k"]) for r in rows):
        got = {r["variant"]: r for r in rows if (r["seqlen_q"], r["seqlen_k"]) == (n_q, n_k)}
        if not all(v in got for v in ("split_kv", "tuned", "sdpa_flash")):
            continue
        sk, tu, fl = got["split_kv"], got["tuned"], got["sdpa_flash"]
        lines.append(f"| {n_q} | {n_k} | {sk['GBps']:.0f} ({sk['pct_of_copy']:.0f}%) | {tu['pct_of_copy']:.0f}% | "
                     f"{fl['pct_of_copy']:.0f}% | {fl['median_ms'] / sk['median_ms']:.2f} |")
    lines += ["", f"{_where(record)}; copy {record['ceilings']['copy_GBps']:.0f} GB/s in the same run."]
    return "\n".join(lines)


def memory_line(record):
    rows = {r["variant"]: r for r in results.rows(record, op="attention_memory") if not r.get("grad")}
    ours = rows.get("tuned") or rows.get("default")
    flash, math = rows.get("sdpa_flash"), rows.get("sdpa_math")
    if not (ours and flash):
        return "(not measured)"
    parts = [f"`{ours['variant']}` {ours['extra_MiB']:.0f} MiB, sdpa_flash {flash['extra_MiB']:.0f} MiB"]
    if math:
        parts.append(f"sdpa_math {math['extra_MiB']:.0f} MiB")
    return ", ".join(parts) + f" ({_where(record)})"


def error_line(record):
    rows = results.rows(record, op="attention_error")
    ours = [r for r in rows if not r["variant"].startswith("sdpa")]
    if not ours:
        return "(not measured)"
    worst = max(ours, key=lambda r: r["ratio_vs_sdpa_flash"])
    held = all(r["within_2x_sdpa_flash"] for r in ours)
    return (f"{'every' if held else 'not every'} rung's worst error is within 2x sdpa_flash's; the largest ratio "
            f"is {worst['ratio_vs_sdpa_flash']:.2f} ({worst['variant']}, {worst['pass']}, {worst['dtype']}, "
            f"causal={worst['causal']}) ({_where(record)})")


def varlen_table(_record):
    """bench_attention.py --ops attention_varlen's rows (their own results file): per pass, each
    variant's time, its TFLOP/s of useful work, the layout it ran on, and its speed against
    sdpa_cudnn on the padded batch."""
    rec = results.load_recorded_gpu("chapter6_flash_attention_varlen")
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op="attention_varlen")
    lines = ["| pass | variant | layout | ms | TFLOP/s (useful) | x sdpa_cudnn |", "|---|---|---|---|---|---|"]
    for r in rows:
        name = f"`{r['variant']}`" + (f" ({r['dispatch']})" if "dispatch" in r else "")
        speed = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        lines.append(f"| {r['pass']} | {name} | {r['layout']} | {r['median_ms']:.2f} | {r['TFLOPs']:.0f} | {speed} |")
    lines += ["", f"{_where(rec)}; bfloat16 matmul measured in the same run: "
                  f"{rec['ceilings']['mm_TFLOPs']:.0f} TFLOP/s."]
    return "\n".join(lines)


def _masked(row):
    """Whether a row of the masked sections ran the mask (not the dense causal call beside it)."""
    return (row["window"], row["softcap"]) != ([-1, -1], 0.0)


def _masked_table(op, targets):
    """bench_attention.py --ops `op`'s rows (their own results file): each variant's time and
    TFLOP/s of the masked call's useful work, per pass, then the targets of version=None's masked
    call: x flex_attention, and against the course's own dense causal call (`dense`: the measured
    ratio and whether it meets the target)."""
    rec = results.load_recorded_gpu(f"chapter6_flash_attention_{op.removeprefix('attention_')}")
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op=op)
    lines = ["| pass | variant | mask | ms | TFLOP/s (useful) | x flex_attention |", "|---|---|---|---|---|---|"]
    for r in rows:
        name = f"`{r['variant']}`" + (f" ({r['dispatch']})" if "dispatch" in r else "")
        mask = (f"window ({r['window'][0]}, {r['window'][1]})" if op == "attention_window" else
                f"softcap {r['softcap']:g}") if _masked(r) else "none (dense causal)"
        speed = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        lines.append(f"| {r['pass']} | {name} | {mask} | {r['median_ms']:.2f} | {r['TFLOPs']:.0f} | {speed} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for pass_ in ("forward", "backward"):
        got = {(r["variant"], _masked(r)): r for r in rows if r["pass"] == pass_}
        ours, flex, dense = got.get(("default", True)), got.get(("flex_attention", True)), got.get(("default", False))
        if ours and flex:
            x = flex["median_ms"] / ours["median_ms"]
            lines.append(f"| {pass_}: `default` >= {targets['flex'][pass_]}x flex_attention | {x:.2f}x | "
                         f"{'yes' if x >= targets['flex'][pass_] else 'no'} |")
        if ours and dense:
            lines.append(targets["dense"](pass_, ours, dense))
    r0 = rows[0]
    lines += ["", f"{_where(rec)}; {r0['dtype']} b{r0['batch']} h{r0['heads']} s{r0['seqlen']} d{r0['head_dim']} "
                  f"causal; every row credited the masked call's useful work; a bf16 matmul reached "
                  f"{rec['ceilings']['mm_TFLOPs']:.0f} TFLOP/s in the same run."]
    return "\n".join(lines)


def window_table(_record):
    """The sliding window's rows and targets: >= 1.3x / 1.2x flex_attention (forward / backward),
    and a time per visible (query, key) pair within 1.2x of the dense causal call's (the band's work
    done about as fast as dense attention does the same amount)."""
    def dense(pass_, ours, dense):
        x = (ours["median_ms"] / ours["visible_pairs"]) / (dense["median_ms"] / dense["visible_pairs"])
        return (f"| {pass_}: time per visible pair <= 1.2x the dense causal `default`'s | {x:.2f}x | "
                f"{'yes' if x <= 1.2 else 'no'} |")
    return _masked_table("attention_window", {"flex": {"forward": 1.3, "backward": 1.2}, "dense": dense})


def softcap_table(_record):
    """Softcapping's rows and targets: >= 1.3x / 1.2x flex_attention (forward / backward), and
    >= 0.75x the speed of the course's own dense causal call without the softcap (the tanh's cost)."""
    def dense(pass_, ours, dense):
        x = dense["median_ms"] / ours["median_ms"]
        return (f"| {pass_}: `default` >= 0.75x the same call without softcap | {x:.2f}x | "
                f"{'yes' if x >= 0.75 else 'no'} |")
    return _masked_table("attention_softcap", {"flex": {"forward": 1.3, "backward": 1.2}, "dense": dense})


def transformers_table(_record):
    """bench_attention.py --ops transformers_model's rows (their own results file): the Llama-style
    model's forward on the chapter's attention and on transformers' SDPA path (same weights), and the
    logits' distance from the SDPA path's, beside what SDPA's own two backends differ by."""
    rec = results.load_recorded_gpu("chapter6_flash_attention_transformers")
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op="transformers_model")
    got = {r["variant"]: r for r in rows}
    lines = ["| variant | ms | TFLOP/s (model) | x sdpa | logits vs `sdpa`: max | rms |", "|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        lines.append(f"| `{r['variant']}` | {r['median_ms']:.2f} | {r['TFLOPs']:.0f} | {speed} | "
                     f"{r['logits_max_abs_diff']:.3g} | {r['logits_rms_diff']:.3g} |")
    ours, sdpa = got.get("default"), got.get("sdpa")
    rounding = [got[v]["logits_rms_diff"] for v in ("sdpa_flash", "sdpa_cudnn") if v in got and got[v]["logits_rms_diff"] > 0]
    if ours and sdpa:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        x = sdpa["median_ms"] / ours["median_ms"]
        lines.append(f"| forward time <= the SDPA path's | {x:.2f}x its speed | {'yes' if x >= 1.0 else 'no'} |")
        if rounding:
            y = ours["logits_rms_diff"] / max(rounding)
            lines.append(f"| logits within bf16 rounding of the SDPA path (rms distance <= that of SDPA's other "
                         f"backend) | {y:.2f}x | {'yes' if y <= 1.0 else 'no'} |")
    r0 = rows[0]
    lines += ["", f"{_where(rec)}; transformers {r0['transformers']}; {r0['num_hidden_layers']} layers of "
                  f"{r0['hidden_size']}, {r0['num_attention_heads']}/{r0['num_key_value_heads']} heads, "
                  f"{r0['dtype']}, {r0['batch']} x {r0['seqlen']} tokens; logits rms {r0['logits_rms']:.3g}."]
    return "\n".join(lines)


def _profile():
    return results.load_recorded_gpu("chapter6_flash_attention_profile")


def profile_table(_record):
    """profile_attention.py's ncu counters, one row per call: the call's longest kernel's
    resources (registers, shared memory, the blocks an SM holds and what binds them), how busy
    its tensor pipe was and where its warps stalled most."""
    prof = _profile()
    if not prof:
        return "(no ncu profile recorded yet: profile_attention.py on a GPU records it)"
    lines = ["| pass | d | causal | variant | kernels | ms under ncu | registers | shared KiB | blocks / SM "
             "(bound by) | tensor pipe busy | top stall (warps per issue) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in prof["benchmarks"]:
        stall = "-" if r.get("top_stall") is None else f"{r['top_stall']} ({r['top_stall_ratio']:.2f})"
        tensor = "-" if r.get("tensor_pipe_pct") is None else f"{r['tensor_pipe_pct']:.0f}%"
        lines.append(f"| {r['pass']} | {r['head_dim']} | {r['causal']} | `{r['variant']}` | {r['launches']} | "
                     f"{r['duration_ns'] / 1e6:.3f} | {r['registers']:.0f} | {r['smem_per_block_KiB']:.0f} | "
                     f"{r['blocks_per_sm']:.0f} ({r['occupancy_bound_by']}) | {tensor} | {stall} |")
    w = prof["workload"]
    lines += ["", f"ncu, {w['dtype']} {w['batch']} x {w['heads']} heads x {w['seqlen']}; per call its longest "
                  f"kernel's counters, the time of all its kernels; {_where(prof)}."]
    return "\n".join(lines)


def profile_backward(_record):
    """How busy the tensor pipe was in each backward at the largest profiled head dim."""
    prof = _profile()
    rows = [r for r in prof["benchmarks"] if r["pass"] == "backward"] if prof else []
    if not rows:
        return "(not profiled yet)"
    d = max(r["head_dim"] for r in rows)
    by = {r["variant"]: r for r in rows if r["head_dim"] == d and r.get("tensor_pipe_pct") is not None}
    return ", ".join(f"`{v}` {by[v]['tensor_pipe_pct']:.0f}%" for v in ("mma_dqpass", "mma", "sdpa_flash")
                     if v in by) + f" of the time at d = {d}"


def tiny_gpt_line(record):
    gpt = results.load_recorded_gpu("chapter6_tiny_gpt")
    if not gpt:
        return "(not recorded yet)"
    by = {r["backend"]: r for r in gpt["benchmarks"] if r["op"] == "tiny_gpt_train"}
    c = gpt["comparison"]
    tok = ", ".join(f"{b} {by[b]['tokens_per_s']:,.0f} tokens/s" for b in ("flash", "sdpa") if b in by)
    ran = by["flash"].get("dispatch")
    ran = f"; flash ran the `{ran['forward']}` forward and the `{ran['backward']}` backward" if ran else ""
    return (f"over {by['flash']['steps']} steps the largest difference between the two loss curves was "
            f"{c['max_abs_diff']:.3g} (step {c['at_step']}; tolerance {c['tolerance']}), and {tok}{ran} "
            f"({gpt['device']['name']}, {gpt['date'][:10]})")


# ---------------------------------------------------------------------------------------------
# Part 2, serving: bench_paged.py's record (chapter6_paged_attention) and generate_paged.py's
# ---------------------------------------------------------------------------------------------
def _paged():
    return results.load_recorded_gpu("chapter6_paged_attention")


def _label(r):
    n = f"mixed in [1, {r['context_range'][1]}]" if r.get("mixed") else f"{r['context']}"
    extra = "".join(f", {x}" for x in (f"d {r['head_dim']}" if r["head_dim"] != 128 else "",
                                       f"block {r['block_size']}" if r["block_size"] != 16 else "",
                                       r["dtype"] if r["dtype"] != "bfloat16" else "") if x)
    return f"batch {r['batch']}, context {n}, {r['heads']}/{r['heads_kv']} heads{extra}"


def paged_targets(_record):
    """This chapter's decode configurations: every rung and PyTorch's two baselines, % of copy, and the
    target held to default."""
    rec = _paged()
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op="paged_attention", sweep="targets")
    targets = {t["target"]: t for t in rec["targets"]}
    cols = ("per_head", "per_kv_head", "split_kv", "default", "sdpa_contiguous", "sdpa_gathered")
    lines = ["| config | " + " | ".join(f"`{c}`" for c in cols) + " | default x sdpa_contiguous | target | met |",
             "|---|" + "---|" * (len(cols) + 3)]
    for c in dict.fromkeys(r["config"] for r in rows):
        got = {r["variant"]: r for r in rows if r["config"] == c}
        cells = [f"{got[v]['pct_of_copy']:.1f}%" if v in got else "-" for v in cols]
        t = targets.get(c)
        want = "-" if t is None else f">= {t['min_pct_of_copy']}%" + (
            f", >= {t['min_speedup_vs_sdpa_contiguous']}x" if t["min_speedup_vs_sdpa_contiguous"] else "")
        speed = got.get("default", {}).get("speedup_vs_torch")
        lines.append(f"| {c}: {_label(got['default'] if 'default' in got else next(iter(got.values())))} | "
                     + " | ".join(cells) + f" | {'-' if speed is None else f'{speed:.3f}x'} | {want} | "
                     + ("-" if t is None else "yes" if t["met"] else "**no**") + " |")
    lines += ["", f"{_where(rec)}; copy {rec['ceilings']['copy_GBps']:.0f} GB/s in the same run; % of copy over "
                  "the unique K/V bytes (plus q and out)."]
    return "\n".join(lines)


def paged_gqa(_record):
    rec = _paged()
    rows = results.rows(rec, op="paged_attention", sweep="gqa") if rec else []
    if not rows:
        return "(not recorded yet)"
    kv = sorted(dict.fromkeys(r["heads_kv"] for r in rows), reverse=True)
    variants = [v for v in ("per_head", "per_kv_head", "default", "sdpa_contiguous", "repeat_kv")
                if any(r["variant"] == v for r in rows)]
    lines = ["| variant | " + " | ".join(f"{rows[0]['heads']}/{n} (group {rows[0]['heads'] // n})" for n in kv)
             + " |", "|---|" + "---|" * len(kv)]
    for v in variants:
        got = {r["heads_kv"]: r["pct_of_copy"] for r in rows if r["variant"] == v}
        lines.append(f"| `{v}` | " + " | ".join(f"{got[n]:.1f}%" if n in got else "-" for n in kv) + " |")
    lines += ["", f"{_where(rec)}; % of copy over each configuration's own unique K/V bytes."]
    return "\n".join(lines)


def paged_split(_record):
    rec = _paged()
    rows = results.rows(rec, op="paged_attention", sweep="split_kv") if rec else []
    if not rows:
        return "(not recorded yet)"
    ctx = sorted(dict.fromkeys(r["context"] for r in rows))
    lines = ["| batch | variant | " + " | ".join(f"{n // 1024}K" for n in ctx) + " |",
             "|---|---|" + "---|" * len(ctx)]
    for b in dict.fromkeys(r["batch"] for r in rows):
        for v in ("per_kv_head", "split_kv", "default", "sdpa_contiguous"):
            got = {r["context"]: r["pct_of_copy"] for r in rows if r["batch"] == b and r["variant"] == v}
            if got:
                lines.append(f"| {b} | `{v}` | " + " | ".join(f"{got[n]:.0f}%" if n in got else "-" for n in ctx)
                             + " |")
    lines += ["", f"{_where(rec)}; % of copy."]
    return "\n".join(lines)


def paged_num_splits(_record):
    rec = _paged()
    rows = results.rows(rec, op="paged_attention", sweep="num_splits") if rec else []
    if not rows:
        return "(not recorded yet)"
    counts = sorted(dict.fromkeys(r["num_splits"] for r in rows if "num_splits" in r))
    lines = ["| config | " + " | ".join(f"{n}" for n in counts) + " | default | `sdpa_contiguous` |",
             "|---|" + "---|" * (len(counts) + 2)]
    for c in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == c]
        got = {r["num_splits"]: r["pct_of_copy"] for r in mine if "num_splits" in r}
        best = max(got, key=got.get)
        other = {r["variant"]: r["pct_of_copy"] for r in mine if "num_splits" not in r}
        cells = [(f"**{got[n]:.1f}%**" if n == best else f"{got[n]:.1f}%") if n in got else "-" for n in counts]
        lines.append(f"| {c}: {_label(mine[0])} | " + " | ".join(cells)
                     + f" | {other.get('default', float('nan')):.1f}% | {other.get('sdpa_contiguous', float('nan')):.1f}% |")
    lines += ["", f"{_where(rec)}; % of copy of `split_kv` with `num_splits` named, the best in bold."]
    return "\n".join(lines)


def paged_cache_ops(_record):
    rec = _paged()
    rows = [r for r in rec["benchmarks"] if r["op"] in ("reshape_and_cache", "copy_blocks")] if rec else []
    if not rows:
        return "(not recorded yet)"
    lines = ["| op | size | ours: µs, % of copy | PyTorch's index ops: µs, % of copy | x PyTorch |", "|---|---|---|---|---|"]
    for op, n in dict.fromkeys((r["op"], r["shape"][0]) for r in rows):
        got = [r for r in rows if (r["op"], r["shape"][0]) == (op, n)]
        ours = next((r for r in got if not r["variant"].startswith("torch")), None)
        base = next((r for r in got if r["variant"].startswith("torch")), None)
        if not (ours and base):
            continue
        size = f"{n} tokens" if op == "reshape_and_cache" else f"{n} block pairs"
        lines.append(f"| `{op}` | {size} | {ours['median_ms'] * 1e3:.1f}, {ours['pct_of_copy']:.1f}% | "
                     f"{base['median_ms'] * 1e3:.1f}, {base['pct_of_copy']:.1f}% | "
                     f"{base['median_ms'] / ours['median_ms']:.2f}x |")
    lines += ["", f"{_where(rec)}."]
    return "\n".join(lines)


def paged_match(_record):
    rec = _paged()
    rows = {r["variant"]: r for r in results.rows(rec, op="match_prefix")} if rec else {}
    if "default" not in rows or "cpu" not in rows:
        return "(not recorded yet)"
    g, c = rows["default"], rows["cpu"]
    same = "the same matches as the CPU reference" if g.get("matches_cpu") else "**matches that differ from the CPU**"
    return (f"Measured: {g['requests']} requests × {g['tokens']} tokens against a tree of {g['nodes']:,} nodes "
            f"({g['full_matches']} full matches, {g['partial_matches']} partial, {g['no_matches']} none): the CUDA "
            f"lookup takes {g['median_ms']:.3f} ms ({g['requests_per_s']:.3g} requests/s), the C++ reference on the "
            f"CPU {c['median_ms']:.1f} ms ({c['requests_per_s']:.3g} requests/s), {g['speedup_vs_cpu']:.0f}x, with "
            f"{same}; uploading the mirror once after a change takes {g['mirror_upload_ms']:.1f} ms ({_where(rec)}).")


def generate_line(_record):
    gen = results.load_recorded_gpu("chapter6_generate")
    if not gen:
        return "(not recorded yet)"
    cfg, share = gen["config"], gen["sharing"]
    rows = {(r["dtype"], r["backend"], r["op"]): r for r in gen["benchmarks"]}
    gate = gen["comparison"][gen["match_dtype"]]
    parts = [f"{cfg['groups'] * cfg['per_group']} requests in {cfg['groups']} groups sharing a "
             f"{(cfg['common_blocks'] + cfg['group_blocks']) * cfg['block_size']}-token prefix, "
             f"{cfg['new_tokens']} new tokens each, on {gen['device']['name']} ({gen['date'][:10]}): "
             f"in {gen['match_dtype']} the paged run's greedy tokens were **{gate['verdict']}** to SDPA's "
             f"({gate['identical_requests']}/{gate['requests']} requests, {gate['agreeing_tokens']}/{gate['tokens']} "
             f"tokens; smallest greedy margin {gate['min_reference_margin']:.2g}, largest difference of a chosen "
             f"logit {gate['max_top_logit_diff']:.2g})"]
    for dtype in cfg["dtypes"]:
        dec, ref = rows.get((dtype, "paged", "generate_decode")), rows.get((dtype, "sdpa", "generate_decode"))
        pre = rows.get((dtype, "paged", "generate_prefill"))
        if dec and ref and pre:
            parts.append(f"{dtype}: decode {dec['tokens_per_s']:,.0f} tokens/s ({dec['ms_per_step']:.2f} ms a step "
                         f"of all requests; SDPA with a padded contiguous cache {ref['tokens_per_s']:,.0f}), prefill "
                         f"{pre['tokens_per_s']:,.0f} prompt tokens/s of which it computed "
                         f"{pre['computed_tokens']:,} of {pre['prompt_tokens']:,}")
    other = [d for d in cfg["dtypes"] if d != gen["match_dtype"]]
    for d in other:
        c = gen["comparison"][d]
        parts.append(f"in {d} (not gated) {c['identical_requests']}/{c['requests']} requests stayed identical to "
                     f"SDPA's and {c['agreeing_tokens']}/{c['tokens']} tokens agreed before each request's first "
                     "divergence")
    saved = ", ".join(f"{b / 2**20:.1f} MiB in {d}" for d, b in share["bytes_saved"].items())
    parts.append(f"sharing kept {share['blocks_with_sharing']} blocks where {share['blocks_without_sharing']} "
                 f"would be needed without it, {share['blocks_saved']} saved ({saved} over the model's "
                 f"{cfg['layers']} layers), and the prefill skipped {share['prefix_tokens_skipped']:,} of "
                 f"{share['prompt_tokens']:,} prompt tokens")
    return "; ".join(parts) + "."


def _prefill_record(**match):
    """The newest GPU record holding paged_prefill rows (those matching `match` too, as
    sweep="block_size"): the full benchmark's, or the one bench_paged.py --prefill-only writes
    (chapter6_paged_prefill)."""
    found = [rec for rec in (_paged(), results.load_recorded_gpu("chapter6_paged_prefill"))
             if rec and results.rows(rec, op="paged_prefill", **match)]
    return max(found, key=lambda rec: rec["date"]) if found else None


PREFILL_COLUMNS = ("decode_rows", "mma", "persistent", "default", "attention_varlen", "sdpa_flash",
                   "flex_attention")


def paged_prefill(_record):
    """Chunked prefill: TFLOP/s of the ladder, default, the course's contiguous attention_varlen and
    PyTorch's two, per configuration; default against attention_varlen (on the same keys gathered
    contiguous) and against sdpa_flash."""
    rec = _prefill_record()
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op="paged_prefill", sweep=None)  # the block-size sweep: the next table
    lines = ["| config | " + " | ".join(f"`{c}`" for c in PREFILL_COLUMNS)
             + " | default x `attention_varlen` | default x `sdpa_flash` |",
             "|---|" + "---|" * (len(PREFILL_COLUMNS) + 2)]
    for c in dict.fromkeys(r["config"] for r in rows):
        got = {r["variant"]: r for r in rows if r["config"] == c}
        r0 = next(iter(got.values()))
        what = (f"{c}: {r0['prefill_chunks']} chunks (<= {r0['max_seqlen_q']} tokens)"
                + (f" + {r0['decode_tokens']} decode tokens" if r0["decode_tokens"] else "")
                + f", contexts <= {r0['context']}, {r0['heads']}/{r0['heads_kv']} heads, d {r0['head_dim']}")
        cells = [f"{got[v]['TFLOPs']:.0f}" if v in got else "-" for v in PREFILL_COLUMNS]
        speed = got.get("default", {}).get("speedup_vs_torch")
        dispatch = got.get("default", {}).get("dispatch")
        contiguous = (got["attention_varlen"]["median_ms"] / got["default"]["median_ms"]
                      if "attention_varlen" in got and "default" in got else None)
        lines.append(f"| {what} | " + " | ".join(cells) + f" | {'-' if contiguous is None else f'{contiguous:.2f}x'}"
                     + f" | {'-' if speed is None else f'{speed:.2f}x'}"
                     + (f" (`{dispatch}`)" if dispatch else "") + " |")
    lines += ["", f"{_where(rec)}; TFLOP/s over the (query, key) pairs the causal mask leaves visible, bf16; "
                  f"a bf16 matmul reached {rec['ceilings']['mm_TFLOPs']:.0f} TFLOP/s in the same run."]
    return "\n".join(lines)


def paged_prefill_block_size(_record):
    """The "prefix" configuration by block size: default and attention_varlen (the same keys gathered
    contiguous) in us, default's speed over attention_varlen's, and how the producer loaded the
    pages (gather: cp.async, tma: a box a page)."""
    rec = _prefill_record(sweep="block_size")
    if not rec:
        return "(not recorded yet)"
    rows = results.rows(rec, op="paged_prefill", sweep="block_size")
    lines = ["| block_size | producer | `default` us | `attention_varlen` us | default x `attention_varlen` |",
             "|---|---|---|---|---|"]
    for bs in sorted(dict.fromkeys(r["block_size"] for r in rows)):
        got = {r["variant"]: r for r in rows if r["block_size"] == bs}
        ours, theirs = got.get("default"), got.get("attention_varlen")
        ratio = theirs["median_ms"] / ours["median_ms"] if ours and theirs else None
        lines.append(f"| {bs} | {(ours or {}).get('producer') or '-'} | "
                     + " | ".join("-" if r is None else f"{r['median_ms'] * 1e3:.0f}" for r in (ours, theirs))
                     + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    r0 = rows[0]
    lines += ["", f"{_where(rec)}; the `{r0['config']}` row ({r0['prefill_chunks']} chunks of {r0['max_seqlen_q']} "
                  f"tokens, contexts {r0['context']}, {r0['heads']}/{r0['heads_kv']} heads, d {r0['head_dim']}, "
                  f"{r0['dtype']}) at each block size; the target is 0.9x."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Part 3 (Hopper): against sdpa_cudnn, the strongest PyTorch backend on Hopper
# ---------------------------------------------------------------------------------------------
HOPPER_RUNGS = ("tuned", "wgmma", "warp_specialized", "pingpong", "persistent")


def _ratios(record, variant, pass_, dtype="bfloat16"):
    """{(head_dim, causal, seqlen): (ours, sdpa_cudnn)} rows of the sweep for `variant`."""
    got = {}
    for r in results.rows(record, op="attention", variant=variant, dtype=dtype, **{"pass": pass_}):
        base = results.rows(record, op="attention", variant="sdpa_cudnn", dtype=dtype, head_dim=r["head_dim"],
                            causal=r["causal"], seqlen=r["seqlen"], **{"pass": pass_})
        if base and not r.get("call"):
            got[(r["head_dim"], r["causal"], r["seqlen"])] = (r, base[0])
    return got


def hopper_targets(record):
    """This part's targets against the measurement: version=None against sdpa_cudnn over the
    whole sweep (bf16), the worst shape named."""
    lines = ["| what | target | measured | met |", "|---|---|---|---|"]

    def worst(pass_, keep=lambda key: True):
        pairs = {k: b["median_ms"] / o["median_ms"] for k, (o, b) in _ratios(record, "default", pass_).items()
                 if keep(k)}
        if not pairs:
            return None
        key = min(pairs, key=pairs.get)
        return pairs[key], key
    for what, target, pass_, keep in (
            ("forward, every sweep shape", 0.9, "forward", lambda k: True),
            ("forward, d128 non-causal, seqlen >= 4096", 1.0, "forward", lambda k: k[0] == 128 and not k[1] and k[2] >= 4096),
            ("backward, every sweep shape", 0.9, "backward", lambda k: True)):
        w = worst(pass_, keep)
        if w is None:
            continue
        ratio, (d, causal, n) = w
        lines.append(f"| {what} | default >= {target}x sdpa_cudnn | {ratio:.2f}x worst (d{d} "
                     f"{'causal' if causal else 'full'} s={n}) | {'yes' if ratio >= target else 'no'} |")
    fp8 = fp8_record(record)
    pairs = []
    for (b, h, n, d, causal), got in (fp8_rows_beside(fp8).items() if fp8 else []):
        if "default" in got and "pingpong" in got and d == 128 and n >= 4096:
            pairs.append((got["pingpong"]["median_ms"] / got["default"]["median_ms"], causal, n))
    if pairs:
        ratio, causal, n = min(pairs)
        lines.append(f"| FP8 forward, d128, seqlen >= 4096 | attention_fp8 >= 1.4x the bf16 forward (pingpong) | "
                     f"{ratio:.2f}x worst ({'causal' if causal else 'full'} s={n}; {_where(fp8)}) | "
                     f"{'yes' if ratio >= 1.4 else 'no'} |")
    rotated = results.rows(fp8, op="attention_rmse", dtype=FP8_DTYPE, rotate=True) if fp8 else []
    if rotated:
        r = rotated[0]
        lines.append(f"| FP8 accuracy, N(0,1) inputs with rare N(0,100) outliers | RMSE vs float64 <= "
                     f"{FP8_RMSE_TARGET:.1e} with rotate_qk | {r['rmse']:.1e} ({_where(fp8)}) | "
                     f"{'yes' if r['rmse'] <= FP8_RMSE_TARGET else 'no'} |")
    lines += ["", f"{_where(record)}; bf16, batch x seqlen = {record['sizes']['tokens']}, heads x head_dim = "
              f"{record['sizes']['hidden']}; x = sdpa_cudnn's time / ours."]
    return "\n".join(lines)


def hopper_rungs(record):
    """Each forward rung at the longest and a middle sequence, head_dim 64 and 128, causal and not:
    TFLOP/s and x sdpa_cudnn (bf16), beside sdpa_flash and sdpa_cudnn themselves."""
    seqlens = record["sizes"]["seqlens"]
    picks = [n for n in (4096, seqlens[-1]) if n in seqlens]
    head = " | ".join(f"d{d} {'causal' if c else 'full'} s={n}" for d in (64, 128) for c in (False, True) for n in picks)
    lines = [f"| rung | {head} |", "|---|" + "---|" * (4 * len(picks))]
    for variant in ("sdpa_flash", "sdpa_cudnn") + HOPPER_RUNGS + ("default",):
        cells = []
        for d in (64, 128):
            for c in (False, True):
                for n in picks:
                    got = results.rows(record, op="attention", variant=variant, dtype="bfloat16", head_dim=d,
                                       causal=c, seqlen=n, **{"pass": "forward"})
                    base = results.rows(record, op="attention", variant="sdpa_cudnn", dtype="bfloat16", head_dim=d,
                                        causal=c, seqlen=n, **{"pass": "forward"})
                    if got and base:
                        cells.append(f"{got[0]['TFLOPs']:.0f} ({base[0]['median_ms'] / got[0]['median_ms']:.2f}x)")
                    else:
                        cells.append("-")
        if set(cells) != {"-"}:  # a rung newer than the results (not measured yet) gets no row
            lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    lines += ["", f"{_where(record)}; forward TFLOP/s (x sdpa_cudnn)."]
    return "\n".join(lines)


def hopper_backward(record):
    """The backward rungs beside sdpa_flash and sdpa_cudnn, at a middle and the longest sequence,
    head_dim 64 and 128, causal and not: TFLOP/s and x sdpa_cudnn (bf16)."""
    seqlens = record["sizes"]["seqlens"]
    picks = [n for n in (seqlens[0], 4096, seqlens[-1]) if n in seqlens]
    head = " | ".join(f"d{d} {'causal' if c else 'full'} s={n}" for d in (64, 128) for c in (False, True) for n in picks)
    lines = [f"| rung | {head} |", "|---|" + "---|" * (4 * len(picks))]
    for variant in ("sdpa_flash", "sdpa_cudnn", "mma", "mma_dqpass", "wgmma", "default"):
        cells = []
        for d in (64, 128):
            for c in (False, True):
                for n in picks:
                    got = [r for r in results.rows(record, op="attention", variant=variant, dtype="bfloat16",
                                                   head_dim=d, causal=c, seqlen=n, **{"pass": "backward"})
                           if not r.get("call")]
                    base = results.rows(record, op="attention", variant="sdpa_cudnn", dtype="bfloat16", head_dim=d,
                                        causal=c, seqlen=n, **{"pass": "backward"})
                    cells.append(f"{got[0]['TFLOPs']:.0f} ({base[0]['median_ms'] / got[0]['median_ms']:.2f}x)"
                                 if got and base else "-")
        if set(cells) != {"-"}:
            lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    lines += ["", f"{_where(record)}; backward TFLOP/s (x sdpa_cudnn)."]
    return "\n".join(lines)


FP8_DTYPE = "float8_e4m3fn"
FP8_RMSE_TARGET = 1.4e-2  # the part's target: FlashAttention 3's per-tensor FP8 error (2.4e-2) well beaten


def fp8_record(record):
    """Where the FP8 rows are: the newer of the main record (a full bench_attention.py run) and
    `--ops attention_fp8`'s own file, of those that hold any (op attention with dtype float8_e4m3fn,
    or op attention_rmse); None when neither does."""
    found = [r for r in (record, results.load_recorded_gpu("chapter6_flash_attention_fp8"))
             if r and (results.rows(r, op="attention", dtype=FP8_DTYPE) or results.rows(r, op="attention_rmse"))]
    return max(found, key=lambda r: r["date"]) if found else None


def fp8_rows_beside(record):
    """{(batch, heads, seqlen, head_dim, causal): {column: row}}: each shape with an FP8 row, its FP8
    rows (by results.column: "default", "default (quantize_fp8 + attention_fp8)") and the bf16
    forward rows of sdpa_cudnn and pingpong of that shape (the sweep's, or those timed beside them)."""
    keys = [(r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"])
            for r in results.rows(record, op="attention", dtype=FP8_DTYPE)]
    out = {}
    for key in dict.fromkeys(keys):
        got = {}
        for r in results.rows(record, op="attention", **{"pass": "forward"}):
            if (r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"]) != key:
                continue
            if r["dtype"] == FP8_DTYPE:
                got[results.column(r)] = r
            elif r["dtype"] == "bfloat16" and r["variant"] in ("sdpa_cudnn", "pingpong") and not r.get("call"):
                got[r["variant"]] = r
        out[key] = got
    return out


def hopper_fp8(record):
    """The FP8 forward (op attention, dtype float8_e4m3fn, variant default) beside the bf16 rows of
    sdpa_cudnn and pingpong of its shape, and with the three quantizations inside the timed call."""
    rec = fp8_record(record)
    shapes = fp8_rows_beside(rec) if rec else {}
    if not shapes:
        return "(not recorded yet)"
    lines = ["| shape | `sdpa_cudnn` (bf16) | `pingpong` (bf16) | `attention_fp8` | x `pingpong` | with `quantize_fp8` |",
             "|---|---|---|---|---|---|"]
    for (b, h, n, d, causal), got in shapes.items():
        def cell(name):
            return f"{got[name]['TFLOPs']:.0f}" if name in got else "-"
        fp8, bf16 = got.get("default"), got.get("pingpong")
        vs = f"{bf16['median_ms'] / fp8['median_ms']:.2f}x" if fp8 and bf16 else "-"
        lines.append(f"| b{b} h{h} s{n} d{d} {'causal' if causal else 'full'} | {cell('sdpa_cudnn')} | "
                     f"{cell('pingpong')} | {cell('default')} | {vs} | "
                     f"{cell('default (quantize_fp8 + attention_fp8)')} |")
    lines += ["", f"{_where(rec)}; forward TFLOP/s (the same FLOP count for every dtype, so they compare times)."]
    return "\n".join(lines)


def fp8_accuracy(record):
    """The attention_rmse rows: RMSE of the output against float64 on inputs with rare outliers,
    attention_fp8 with per-tensor scales without and with rotate_qk, and the bf16 forward."""
    rec = fp8_record(record)
    rows = results.rows(rec, op="attention_rmse") if rec else []
    if not rows:
        return "(not recorded yet)"
    lines = ["| forward | scales | `rotate_qk` | RMSE vs float64 | max abs error |", "|---|---|---|---|---|"]
    for r in rows:
        what = "`attention_fp8` (e4m3)" if r["dtype"] == FP8_DTYPE else f"`attention` ({r['dtype']})"
        rotate = ("yes" if r["rotate"] else "no") if "rotate" in r else "-"
        scales = r.get("descale", "-").replace("_", "-")
        lines.append(f"| {what} | {scales} | {rotate} | {r['rmse']:.1e} | {r['max_abs_err']:.1e} |")
    b, h, n, d = rows[0]["shape"]
    lines += ["", f"{_where(rec)}; q, k, v of b{b} h{h} s{n} d{d}, each entry {rows[0]['inputs']}."]
    return "\n".join(lines)


def hopper_gemm(record):
    """Rung 0: the Hopper GEMM program against torch.mm at 8192^3, both timed in the same run."""
    rows = results.rows(record, op="gemm_hopper")
    if not rows:
        return "(no Hopper GEMM rows in the newest results: they need a Hopper GPU and nvcc)"
    parts = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        got = {r["variant"]: r for r in rows if r["layout"] == layout}
        ours, mm = got["hopper_gemm"], got["torch.mm"]
        parts.append(f"C = {layout} ({ours['b_major']} B): `hopper_gemm` {ours['TFLOPs']:.0f} TFLOP/s against "
                     f"torch.mm's {mm['TFLOPs']:.0f}, {ours['speedup_vs_torch']:.2f}x cuBLAS"
                     f"{'' if ours['checked'] else ' (its checks FAILED)'}")
    return "; ".join(parts) + f" ({_where(record)})."


def hopper_configs(record):
    """experiments/hopper_forward_check.cu --variants: each configuration's TFLOP/s, per head dim and
    mask, at the program's timing shapes (bf16)."""
    rows = results.rows(record, op="attention_hopper_config")
    if not rows:
        return "(no configuration rows in the newest results: they need a Hopper GPU and nvcc)"
    shapes = list(dict.fromkeys((r["head_dim"], r["causal"], r["shape"][0], r["shape"][1], r["seqlen"]) for r in rows))
    lines = ["| configuration | " + " | ".join(f"d{d} {'causal' if c else 'full'} (b{b} h{h} s{n})"
                                              for d, c, b, h, n in shapes) + " |",
             "|---|" + "---|" * len(shapes)]
    for name in dict.fromkeys(r["variant"] for r in rows):
        cells = []
        for d, c, b, h, n in shapes:
            got = [r for r in rows if r["variant"] == name and (r["head_dim"], r["causal"], r["seqlen"]) == (d, c, n)]
            cells.append(f"{got[0]['TFLOPs']:.0f}" if got else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"{_where(record)}; TFLOP/s, bf16 ({rows[0]['timer']})."]
    return "\n".join(lines)


STORE_WIDTH_BASE = "persistent joint+pingpong n128 3st"  # hopper_forward_check.cu's row; " o4", " o8" beside it


def hopper_store_width(record):
    """The epilogue's store width (HopperFwdConfig's kOStoreBytes) from hopper_forward_check's rows:
    the 16-byte row (the rungs') against its 4- and 8-byte twins, d = 128, at each timing shape."""
    rows = results.rows(record, op="attention_hopper_config", head_dim=128)
    parts = []
    for d, c, n in dict.fromkeys((r["head_dim"], r["causal"], r["seqlen"]) for r in rows):
        got = {r["variant"]: r for r in rows if (r["causal"], r["seqlen"]) == (c, n)}
        base, o4 = got.get(STORE_WIDTH_BASE), got.get(STORE_WIDTH_BASE + " o4")
        if base and o4:
            o8 = got.get(STORE_WIDTH_BASE + " o8")
            parts.append(f"{'causal' if c else 'full'} {n} keys: {base['TFLOPs']:.0f} TFLOP/s against {o4['TFLOPs']:.0f} "
                         f"with 4-byte stores ({o4['median_ms'] / base['median_ms'] - 1:+.0%} time for those)"
                         + (f" and {o8['TFLOPs']:.0f} with 8-byte ones" if o8 else ""))
    if not parts:
        return "(no store-width rows in the newest results: they need a Hopper GPU and nvcc)"
    return "; ".join(parts) + f" ({_where(record)})"


def _hopper_file(record, name):
    """A text file a part 3 GPU run wrote, and the card it ran on: the one beside the record (same
    device slug) if there is one, else the one beside the newest record of another card that has
    it (a probe is run less often than the benchmark, so the newest benchmark may come from a card
    the probe has not run on yet). (None, None) if no card has it."""
    own = results.device_slug(record["device"])
    for slug, other in [(own, record)] + [sr for sr in results.load_all(record["chapter"]) if sr[0] != own]:
        path = results.RESULTS_DIR / slug / name
        if path.exists():
            return path, other["device"]["name"]
    return None, None


def hopper_profile(record):
    """profile_attention.py --only on the Hopper rungs, tuned and sdpa_cudnn at d128 (its printed
    table, results/<gpu>/chapter6_hopper_profile.txt): time and TFLOP/s under ncu, registers,
    shared memory, the tensor pipes' busy share, the top stall."""
    path, card = _hopper_file(record, "chapter6_hopper_profile.txt")
    if path is None:
        return "(no Hopper profile recorded)"
    lines = ["| variant | causal | ms under ncu | TFLOP/s | registers | shared KiB | tensor pipes busy | top stall (warps per issue) |",
             "|---|---|---|---|---|---|---|---|"]
    header = None
    for line in path.read_text().splitlines():
        if line.startswith("chapter6_flash_attention_profile,"):
            header = line.split(";")[0]
        f = line.split()
        if len(f) >= 16 and f[0] == "forward":
            # the profile's table cuts names at 11 characters: the variant it begins
            f[1] = next((v for v in HOPPER_RUNGS + ("sdpa_cudnn", "sdpa_flash", "attention_fp8")
                         if v.startswith(f[1])), f[1])
            lines.append(f"| `{f[1]}` | {f[3]} | {f[5]} | {float(f[6]):.0f} | {f[7]} | {f[8]} | {f[12]}% | "
                         f"{f[14]} {f[15]} |")
    lines += ["", f"{header or 'ncu'}; `{path.relative_to(results.RESULTS_DIR.parent)}` ({card})."]
    return "\n".join(lines)


def hopper_power(record):
    """experiments/power_probe.py: 4-second bursts of each forward at b2 h16 s8192 d128, its
    TFLOP/s beside the SM clock and power nvidia-smi logged during the burst."""
    probe, card = _hopper_file(record, "chapter6_hopper_power_probe.txt")
    smi, smi_card = _hopper_file(record, "chapter6_hopper_power_probe_smi.csv")
    if probe is None or smi is None or smi_card != card:
        return "(no power probe recorded)"
    import csv
    def seconds(hms):
        h, m, sec = (float(x) for x in hms.split(":"))
        return 3600 * h + 60 * m + sec
    samples = []
    for row in list(csv.reader(smi.open()))[1:]:
        if len(row) >= 3:
            samples.append((seconds(row[0].split()[1]), float(row[1].split()[0]), float(row[2].split()[0])))
    bursts = [line.split() for line in probe.read_text().splitlines() if "TFLOP/s" in line]
    lines = ["| burst | variant | TFLOP/s | SM clock (MHz) | power (W) |", "|---|---|---|---|---|"]
    for i, f in enumerate(bursts):
        end = seconds(f[0])  # each line is printed as its 4-second burst ends
        start = seconds(bursts[i - 1][0]) if i else end - 4.0
        during = [(c, w) for t, c, w in samples if start <= t < end]
        clock = sum(c for c, _ in during) / len(during) if during else float("nan")
        power = sum(w for _, w in during) / len(during) if during else float("nan")
        lines.append(f"| {i + 1} | `{f[1]}` | {f[-2]} | {clock:.0f} | {power:.0f} |")
    lines += ["", f"{card}; `experiments/power_probe.py` and nvidia-smi every 0.5 s "
              "(results/<gpu>/chapter6_hopper_power_probe.txt, _smi.csv)."]
    return "\n".join(lines)


def hopper_persistent(record):
    """experiments/persistent_probe.py: pingpong, persistent and sdpa_cudnn at seven shapes, each a
    CUDA graph, interleaved over 7 rounds (results/<gpu>/chapter6_persistent_probe.txt)."""
    import re
    probe, card = _hopper_file(record, "chapter6_persistent_probe.txt")
    if probe is None:
        return "(no persistent probe recorded)"
    text = probe.read_text().splitlines()
    lines = ["| shape (bf16, forward) | `pingpong` TFLOP/s | `persistent` TFLOP/s | `sdpa_cudnn` TFLOP/s | "
             "persistent / pingpong | persistent / cuDNN | same bits |", "|---|---|---|---|---|---|---|"]
    for line in text:
        cells = re.findall(r"([\d.]+|nan) \(([\d.]+|nan)\)", line)
        ratios = re.findall(r"([\d.]+|nan)x", line)
        if len(cells) == 3 and len(ratios) >= 2:
            name = line[:30].strip()
            lines.append(f"| {name} | " + " | ".join(c[0] for c in cells) +
                         f" | {ratios[0]}x | {ratios[1]}x | {line.split()[-1]} |")
    # the import's build line comes first when the extension was JIT-loaded: the header is the "#" line
    header = next((line.lstrip("# ") for line in text if line.startswith("#")), card)
    lines += ["", f"{header}; `experiments/persistent_probe.py` (results/<gpu>/chapter6_persistent_probe.txt)."]
    return "\n".join(lines)


def hopper_backward_source(record):
    """profile_attention.py's source view of the backward (its --source-csv table under a header
    that says how it was taken, results/<gpu>/chapter6_hopper_backward_source_s2048.txt): the
    instructions the warps sat at most, their share of the stall samples and their largest reasons."""
    path, _ = _hopper_file(record, "chapter6_hopper_backward_source_s2048.txt")
    if path is None:
        return "(no source view recorded)"
    text = path.read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.lstrip().startswith("#  samples"))
    lines = ["| share of the samples | largest stall reasons (samples) | instruction |", "|---|---|---|"]
    for line in text[start + 1:start + 8]:
        # "  967    15386  10.2%  barrier 15362, selected 24   WARPGROUP.DEPBAR.LE gsb0, 0x0": the reasons
        # are the "name count" pairs after the share, the instruction what follows them.
        fields = line.split()
        share, rest = fields[2], line.split(fields[2], 1)[1]
        m = re.match(r"\s*((?:[a-z_]+ \d+(?:, )?)*)\s+(.*)", rest)
        lines.append(f"| {share} | {m.group(1).strip()} | `{m.group(2).strip()}` |")
    lines += ["", text[0]]
    return "\n".join(lines)


def hopper_backward_ratios(record):
    """The Hopper backward against cuDNN's over the sweep (bf16): the default rows' range per head
    dim, and at d = 128 the range of the wgmma rows too (the same kernel, timed as its own variant)."""
    def span(variant, head_dim):
        got = [b["median_ms"] / o["median_ms"] for (d, _, _), (o, b) in _ratios(record, variant, "backward").items()
               if d == head_dim]
        return f"{min(got):.2f}-{max(got):.2f}x" if got else "(not recorded)"
    return (f"d = 128's `default` rows {span('default', 128)} cuDNN (its `wgmma` rows, the same kernel timed as "
            f"a variant of its own, {span('wgmma', 128)}), d = 64's {span('default', 64)} ({_where(record)})")


FACTS = {"target_table": target_table, "split_kv": split_kv_table, "memory": memory_line, "error": error_line,
         "profile_table": profile_table, "profile_backward": profile_backward,
         "tiny_gpt": tiny_gpt_line, "paged_targets": paged_targets, "paged_gqa": paged_gqa,
         "paged_split": paged_split, "paged_num_splits": paged_num_splits, "paged_cache_ops": paged_cache_ops,
         "paged_match": paged_match, "paged_prefill": paged_prefill,
         "paged_prefill_block_size": paged_prefill_block_size, "generate": generate_line,
         "hopper_targets": hopper_targets,
         "hopper_rungs": hopper_rungs, "hopper_gemm": hopper_gemm, "hopper_configs": hopper_configs,
         "hopper_store_width": hopper_store_width,
         "hopper_profile": hopper_profile, "hopper_power": hopper_power,
         "hopper_persistent": hopper_persistent, "hopper_backward": hopper_backward,
         "hopper_backward_source": hopper_backward_source, "hopper_backward_ratios": hopper_backward_ratios,
         "hopper_fp8": hopper_fp8, "fp8_accuracy": fp8_accuracy,
         "varlen": varlen_table, "window": window_table, "softcap": softcap_table,
         "transformers": transformers_table}
