"""Checks of where ptxas put the waits for wgmma groups, read from cuobjdump -sass text.

FlashAttention 3's intra-warpgroup overlap (tile i's softmax while tile i - 1's P V is still on the
tensor cores) holds only if the SASS keeps it: the FP8 forward (csrc/hopper/flash_fwd_hopper_fp8.cuh)
and the bf16 overlap schedule (flash_fwd_hopper_kernel.cuh, kOverlap) were each checked by reading
their SASS (NOTES.md, "The FP8 forward's turn shortened", change 2), and these functions repeat that
reading on whatever build the tests or a GPU script load:

- depbar_placement: after each `WARPGROUP.DEPBAR.LE gsb0, 0x1` (Q K^T waited for, P V may run) the
  exponentials (MUFU.EX2) of the softmax follow with no other wait for a wgmma group among them; the
  wait for P V (`0x0`) comes after the last of them (in the source, after the next step's mbarrier
  waits).
- a_register_writes: from each wgmma that reads its A operand from registers (P for P V) to the next
  `WARPGROUP.DEPBAR.LE gsb0, 0x0`, no instruction writes those registers: ptxas treats them as free
  once the wgmma has issued, and a write there changes what the running product reads.

The scan is linear in address order, not along the control flow: from a wgmma in one unrolled step
it runs into the next step's code, whose wait comes early; that is how the kernels are laid out.
Torch-free, so that a GPU script can run it on a library or a cubin with `python3 wgmma_sass.py`.
"""
import argparse
import re
import shutil
import subprocess
import sys

# One SASS instruction: /*addr*/ [@pred] OPCODE operands ;
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"^R(\d+)$")
_PRED = re.compile(r"^!?U?P[T0-9]+$")
_WGMMA = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")


def functions(sass):
    """{mangled name: its SASS} of cuobjdump -sass text."""
    out = {}
    for chunk in sass.split("Function : ")[1:]:
        name, _, body = chunk.partition("\n")
        out[name.strip()] = body
    return out


def instructions(body):
    """[(address, opcode, [operands])] of one function's SASS."""
    out = []
    for m in _LINE.finditer(body):
        ops = [o.strip() for o in m.group(3).split(",")] if m.group(3).strip() else []
        out.append((int(m.group(1), 16), m.group(2), ops))
    return out


def _is_wait(op, ops, level=None):
    return op.startswith("WARPGROUP.DEPBAR") and len(ops) == 2 and ops[0] == "gsb0" and (
        level is None or int(ops[1], 16) == level)


def _written(op, ops):
    """The registers an instruction writes (its first register operand, after any predicate
    destination; wide forms write 2 or 4); none for stores, barriers and wgmma's accumulators."""
    if op.startswith(_WGMMA) or op.startswith(("ST", "RED", "BAR", "SYNCS", "BRA", "WARPGROUP", "EXIT")):
        return set()
    if "SETP" in op.split(".")[0] or op.startswith("PLOP3"):
        return set()  # predicates only (a SHFL's leading PT, by contrast, comes before its register)
    for o in ops:
        if _PRED.match(o):
            continue
        m = _REG.match(o)
        if not m:
            return set()
        width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
        return set(range(int(m.group(1)), int(m.group(1)) + width))
    return set()


def depbar_placement(insts):
    """{"waits_1": n, "waits_0": n, "bad": [address of a 0x1 wait whose softmax has another wgmma
    wait among its exponentials], "without_exp": [0x1 waits followed by no MUFU.EX2 before the next
    wgmma]}. The segment after a 0x1 wait runs to the next wgmma, the next step's issue: ptxas may
    hoist the next step's mbarrier try-wait above the softmax (its retry branch stays after it), so
    the segment does not end at SYNCS; the next step's 0x0 wait belongs after the last MUFU.EX2."""
    res = {"waits_1": 0, "waits_0": 0, "bad": [], "without_exp": []}
    for i, (addr, op, ops) in enumerate(insts):
        if _is_wait(op, ops, 0):
            res["waits_0"] += 1
        if not _is_wait(op, ops, 1):
            continue
        res["waits_1"] += 1
        seg = []
        for a2, op2, ops2 in insts[i + 1:]:
            if op2.startswith(_WGMMA):  # the next step's products: its softmax is another segment
                break
            seg.append((a2, op2, ops2))
        exps = [k for k, (_, op2, _) in enumerate(seg) if op2.startswith("MUFU.EX2")]
        if not exps:
            res["without_exp"].append(addr)
            continue
        if any(_is_wait(op2, ops2) for _, op2, ops2 in seg[:exps[-1]]):
            res["bad"].append(addr)
    return res


def a_register_writes(insts):
    """[(wgmma address, writer address, writer opcode)]: writes to a register-A wgmma's A registers
    before the next `WARPGROUP.DEPBAR.LE gsb0, 0x0`. Also returns how many register-A wgmma it saw."""
    hits, seen = [], 0
    for i, (addr, op, ops) in enumerate(insts):
        if not op.startswith(_WGMMA) or len(ops) < 2:
            continue
        m = _REG.match(ops[1])
        if not m:
            continue  # A from shared memory (a descriptor)
        seen += 1
        a_regs = set(range(int(m.group(1)), int(m.group(1)) + 4))
        for a2, op2, ops2 in insts[i + 1:]:
            if _is_wait(op2, ops2, 0):
                break
            if _written(op2, ops2) & a_regs:
                hits.append((addr, a2, op2))
    return hits, seen


def scan(sass, name_part):
    """{function name: its findings} for the functions whose mangled name holds `name_part`."""
    out = {}
    for name, body in functions(sass).items():
        if name_part not in name:
            continue
        insts = instructions(body)
        hits, seen = a_register_writes(insts)
        out[name] = {**depbar_placement(insts), "register_a_wgmma": seen, "a_register_writes": len(hits),
                     "first_writes": [f"{a:#x} <- {b:#x} {op}" for a, b, op in hits[:5]],
                     "ex2": sum(op.startswith("MUFU.EX2") for _, op, _ in insts),
                     "local_memory": sum(op.startswith(("LDL", "STL")) for _, op, _ in insts)}
    return out


def overlap_ok(found):
    """The overlap's SASS holds: waits 0x1 present, none misplaced, no A register written early."""
    return found["waits_1"] > 0 and not found["bad"] and found["a_register_writes"] == 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary", help="a library, object or cubin (cuobjdump -sass), or a .sass text file")
    parser.add_argument("--kernel", default="HopperFwdOverlapTraits", help="part of the mangled names to check")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = parser.parse_args(argv)
    if args.binary.endswith(".sass"):
        with open(args.binary) as f:
            sass = f.read()
    else:
        sass = subprocess.run([args.cuobjdump, "-sass", args.binary], capture_output=True, text=True,
                              check=True).stdout
    found = scan(sass, args.kernel)
    ok = bool(found)
    for name, f in found.items():
        good = overlap_ok(f)
        ok &= good
        print(f"{'ok ' if good else 'BAD'} {name[:110]}")
        print(f"    DEPBAR.LE gsb0 0x1: {f['waits_1']}, 0x0: {f['waits_0']}, misplaced: {len(f['bad'])}, "
              f"0x1 without exponentials after it: {len(f['without_exp'])}; register-A wgmma {f['register_a_wgmma']}, "
              f"writes to their A registers before the wait: {f['a_register_writes']} {f['first_writes']}; "
              f"MUFU.EX2 {f['ex2']}, LDL/STL {f['local_memory']}")
    if not found:
        print(f"no function holds {args.kernel!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
