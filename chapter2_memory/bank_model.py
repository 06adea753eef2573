"""Predict shared-memory wavefronts from the bank rule, before the GPU says it.

Shared memory has 32 banks of 4 bytes; consecutive 4-byte words sit in consecutive banks. A
warp's access is served in as many passes ("wavefronts") as the most distinct words any one
bank must deliver; lanes that read the same word share it (a broadcast). 8-byte accesses are
served one half-warp at a time. That is the whole model: it takes the 32 addresses a warp
touches and needs no GPU, so it can answer "does this tile layout conflict?" for every shape
and alignment at once. ncu measures the same quantity
(l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld / smsp__inst_executed_op_shared_ld);
test_memory_ops.py holds the model to the counters profile_memory_ops.py recorded.

    python bank_model.py     the transpose gathers of v2, v3, v4 and v5, per element size, and
                             the thin kernels' segment side at every short side up to 64
                             (single elements, and 2-byte segments moved as pairs)

The v5 rows are the prediction NOTES.md quotes: its gathers stay conflict-free in float32 but
not in bfloat16 once destination rows are misaligned (the "first" row of each destination
vector then differs between neighbouring columns).
"""
from collections import defaultdict

BANKS, BANK_BYTES = 32, 4


def wavefronts(addresses, size):
    """Passes needed for one warp instruction: byte addresses of the active lanes (None for an
    inactive lane), each accessing `size` bytes."""
    phases = [addresses[:16], addresses[16:]] if size == 8 else [addresses]
    passes = 0
    for lanes in phases:
        words = defaultdict(set)
        for a in lanes:
            if a is None:
                continue
            for w in range(a // BANK_BYTES, (a + size - 1) // BANK_BYTES + 1):
                words[w % BANKS].add(w)
        passes += max((len(ws) for ws in words.values()), default=0)
    return passes


def tile_column_read(size, pitch):
    """v2/v3: lane x reads tile[x][y] of a 32-row tile with `pitch` elements per row."""
    return wavefronts([x * pitch * size for x in range(32)], size)


def wide_gather(size, pitch, rows_mod=0, stride_mod=0, shift0=0, threads=256):
    """Average wavefronts per shared load of the v4/v5 gather (memory_kernels.cu): lane mapping
    of WideTile's store side, kVec rows per vector, destination vectors starting `first` rows
    into the tile (0 when the destination rows are aligned, i.e. rows_mod == 0), and source rows
    shifted by (shift0 + row * stride_mod) mod kVec (0 everywhere for v4)."""
    vec, cols = 16 // size, 128 // size
    store_lanes = 4 if size == 2 else 8
    total = count = 0
    for i in range(4):
        for warp in range(threads // 32):
            for k in range(vec):
                addresses = []
                for lane in range(32):
                    idx = i * threads + warp * 32 + lane
                    rest = idx // store_lanes
                    col = rest % cols
                    vector = rest // cols * store_lanes + idx % store_lanes
                    first = (-col * rows_mod) % vec
                    row = first + vector * vec + k
                    shift = (shift0 + row * stride_mod) % vec
                    addresses.append((row * pitch + col + shift) * size)
                total += wavefronts(addresses, size)
                count += 1
    return total / count


def thin_log2_pad(short):
    """memory_kernels.cu's pad rule for the thin kernels: a padding element after every 16 run
    positions where the short side is a multiple of 31, after every 32 elsewhere."""
    return 4 if short % 31 == 0 else 5


def thin_segment(size, short, log2_pad=None, run_bytes=8192):
    """Worst wavefronts per warp access of the thin kernels' segment side (transpose_thin_rows'
    tile writes, transpose_thin_cols' tile reads), relative to the fewest the access can take
    (1, or 2 for 8-byte elements): lane i of the block's flat segment index takes short index
    i // L and long index i % L, run position (i % L) * short + i // L, padded."""
    log2_pad = thin_log2_pad(short) if log2_pad is None else log2_pad
    run = run_bytes // size
    long = 1
    while 2 * long * short <= run:
        long *= 2
    worst = 0
    for base in range(0, short * long, 32):
        addresses = []
        for lane in range(32):
            i = base + lane
            k = i % long * short + i // long
            addresses.append(None if i >= short * long else (k + (k >> log2_pad)) * size)
        worst = max(worst, wavefronts(addresses, size) / (2 if size == 8 else 1))
    return worst


def thin_pairs(short, heads, log2_pad=None, run_bytes=8192):
    """Worst wavefronts per warp access of the thin kernels' segment side when 2-byte segments
    move as pairs (memory_kernels.cu, thin_pair_first): lane i of the block's flat item index
    takes short index i // (L / 2) and item q = i % (L / 2), whose long indices are j = 2q - head
    and j + 1 (j = -1 standing for L - 1), each a 2-byte tile access of its own. `heads` gives
    head per short index: "aligned" (every segment starts on a word), "odd" (every one mid-word),
    "alternating" (rows of odd length)."""
    size = 2
    log2_pad = thin_log2_pad(short) if log2_pad is None else log2_pad
    run = run_bytes // size
    long = 1
    while 2 * long * short <= run:
        long *= 2
    half = long // 2
    worst = 0
    for base in range(0, short * half, 32):
        for second in (0, 1):
            addresses = []
            for lane in range(32):
                i = base + lane
                q, r = i % half, i // half
                head = {"aligned": 0, "odd": 1, "alternating": r % 2}[heads]
                j = 2 * q - head + second
                j = long - 1 if j < 0 else j
                k = j * short + r
                addresses.append(None if i >= short * half else (k + (k >> log2_pad)) * size)
            worst = max(worst, wavefronts(addresses, size))
    return worst


V4_PITCH = {4: 33, 2: 66, 8: 17}  # kCols + one 4-byte bank (WideTile)
V5_PITCH = {4: 37, 2: 74, 8: 19}  # 9 chunks of kVec + one bank (AnyAlignmentTile)


def main():
    print(f"{'size':>4}  {'v2 col':>7}{'v3 col':>7}{'v4':>6}{'v5 aligned':>11}"
          f"{'v5 8191x8193':>13}{'v5 worst':>9}")
    for size in (4, 2, 8):
        vec = 16 // size
        padded = 32 + max(1, BANK_BYTES // size)
        worst = max(wide_gather(size, V5_PITCH[size], rm, sm)
                    for rm in range(vec) for sm in range(vec))
        print(f"{size:>4}  {tile_column_read(size, 32):>7}{tile_column_read(size, padded):>7}"
              f"{wide_gather(size, V4_PITCH[size]):>6.2f}{wide_gather(size, V5_PITCH[size]):>11.2f}"
              f"{wide_gather(size, V5_PITCH[size], 8191 % vec, 8193 % vec):>13.2f}{worst:>9.2f}")
    print("\nthin kernels' segment side, worst over short sides 1-64 (times the fewest wavefronts):")
    for size in (4, 2, 8):
        ruled = max(thin_segment(size, s) for s in range(1, 65))
        every32 = {s: thin_segment(size, s, 5) for s in range(1, 65)}
        bad = ", ".join(f"{s}: {w:g}" for s, w in every32.items() if w > ruled)
        print(f"{size:>4}  with the pad rule {ruled:g}; a pad after every 32 alone: {bad}")
    pairs = max(thin_pairs(s, h) for s in range(1, 65) for h in ("aligned", "odd", "alternating"))
    print(f"   2  as pairs (2-byte segments), every head: {pairs:g}")


if __name__ == "__main__":
    main()
