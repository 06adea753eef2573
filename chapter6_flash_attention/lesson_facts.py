"""Measured numbers quoted in this chapter's README, computed from the results files.

tools/report.py fills each <!-- results:NAME:begin -->...<!-- results:NAME:end --> block of
README.md with FACTS[NAME](record), so the prose always matches results/ (no typed numbers).
record is the newest GPU record of bench_attention.py; the tiny GPT's record
(train_tiny_gpt.py) is read here from its own file.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
from coursekit import results  # noqa: E402

# The issue's targets against sdpa_flash (FlashAttention 2 inside PyTorch), per configuration.
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
    sdpa_flash at the shortest and the longest seqlen, against the issue's target."""
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


def tiny_gpt_line(record):
    gpt = results.load_recorded_gpu("chapter6_tiny_gpt")
    if not gpt:
        return "(not recorded yet)"
    by = {r["backend"]: r for r in gpt["benchmarks"] if r["op"] == "tiny_gpt_train"}
    c = gpt["comparison"]
    tok = ", ".join(f"{b} {by[b]['tokens_per_s']:,.0f} tokens/s" for b in ("flash", "sdpa") if b in by)
    return (f"over {by['flash']['steps']} steps the largest difference between the two loss curves was "
            f"{c['max_abs_diff']:.3g} (step {c['at_step']}; tolerance {c['tolerance']}), and {tok} "
            f"({gpt['device']['name']}, {gpt['date'][:10]})")


FACTS = {"target_table": target_table, "split_kv": split_kv_table, "memory": memory_line, "error": error_line,
         "tiny_gpt": tiny_gpt_line}
