"""fused_op's backward at few tokens: the few-rows rule of the backward's tiling
(course::few_rows_width in common/include/course/bias_act.h) and the kernel under each of its
bench-only forms (COURSE_BIAS_GRAD_FEW: auto or fill, the default; narrow; wave).

    pytest test_few_rows.py -x -q              the rule on the CPU (a C++ compiler, no extension)
    pytest test_few_rows.py -x -q -m cuda      the kernel at the boundaries, on a GPU

The rule is host logic in a torch- and CUDA-free header, so its test compiles a small driver of
that header with the machine's C++ compiler and asks it, for any SM count, without a GPU and
without building the chapter. The CUDA test runs the chapter's op.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
INCLUDE = HERE.parent / "common" / "include"
FEW_KNOB = "COURSE_BIAS_GRAD_FEW"
FEW = {"auto": 0, "narrow": 1, "wave": 2}  # course::FewRows: kFill (the default), kNarrow, kWave
THREADS = 256  # course::kGradThreads

# Reads "rows packs pack_bytes rows_in_flight sms phases blocks_per_sm few" a line and prints
# course::grad_tiling's "tx ty column_tiles row_tiles"; "parse VALUE" prints parse_few_rows's
# answer (its FewRows, or -1 where the value names none).
DRIVER = r"""
#include <course/bias_act.h>
#include <iostream>
#include <string>
int main() {
  std::string word;
  while (std::cin >> word) {
    if (word == "parse") {
      std::string value;
      std::cin >> value;
      course::FewRows few;
      const bool ok = course::parse_few_rows(value == "-" ? "" : value.c_str(), &few);
      std::cout << (ok ? static_cast<int>(few) : -1) << "\n";
      continue;
    }
    long long rows = std::stoll(word), packs;
    int pack_bytes, in_flight, sms, phases, blocks, few;
    std::cin >> packs >> pack_bytes >> in_flight >> sms >> phases >> blocks >> few;
    const course::GradTiling t = course::grad_tiling(rows, packs, pack_bytes, in_flight, sms, phases, blocks,
                                                     static_cast<course::FewRows>(few));
    std::cout << t.tx << " " << t.ty << " " << t.column_tiles << " " << t.row_tiles << "\n";
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the rule's driver")
    folder = tmp_path_factory.mktemp("few_rows")
    (folder / "driver.cpp").write_text(DRIVER)
    exe = folder / "driver"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{INCLUDE}", str(folder / "driver.cpp"), "-o", str(exe)],
                   check=True)

    def ask(queries):
        """grad_tiling's (tx, ty, column_tiles, row_tiles) for each query tuple, or parse answers."""
        lines = "\n".join(" ".join(map(str, q)) for q in queries) + "\n"
        out = subprocess.run([str(exe)], input=lines, capture_output=True, text=True, check=True).stdout.split("\n")
        return [tuple(int(v) for v in line.split()) for line in out if line.strip()]
    return ask


def shape_query(tokens, hidden, elem, sms, blocks, few):
    """The query for a tokens x hidden gradient of elem bytes, as the launcher forms it for freshly
    allocated tensors: 16-byte packs where rows are whole vectors, two rows in flight; rows that
    start mid-vector (of at least two vectors) 16-byte packs in phases, one row in flight; others,
    single elements, eight rows in flight."""
    vector = 16 // elem
    phased = hidden % vector != 0 and hidden >= 2 * vector
    lanes = vector if hidden % vector == 0 or phased else 1
    in_flight = 1 if phased else 2 if lanes > 1 else 8
    phases = next(p for p in (1, 2, 4, 8, 16) if p * hidden * elem % 16 == 0) if phased else 1
    return (tokens, -(-hidden // lanes), lanes * elem, in_flight, sms, phases, blocks, FEW[few]), in_flight, phases


TOKENS = (1, 63, 64, 65, 131, 132, 133, 2048)
HIDDEN = (1, 8, 777, 1024, 2048, 3072, 4096, 4099, 8192, 12288, 16384)
GPUS = ((1, 4), (46, 4), (132, 4), (132, 3), (170, 4))


def test_few_rows_rule(driver):
    """The rule against the narrow tiling (the tiling before it), on GPUs of 1 to 170 SMs: both
    widening forms change a tiling only where the narrow grid is one row tile, and then only widen
    it (tx doubled), keeping one row tile (one step of every thread covers the rows: dbias written
    by the kernel, one launch) and at most an eighth of the lanes idle; auto (the default, kFill)
    widens while the grid keeps a block on every SM, wave only while the grid passes the wave and
    stops at the first width whose grid fits it; the tile's rows stay a multiple of the phases.
    Where the narrow tiling has several row tiles, all three agree."""
    cases, queries = [], []
    for elem in (2, 4, 8):
        for sms, blocks in GPUS:
            for tokens in TOKENS:
                for hidden in HIDDEN:
                    q = {few: shape_query(tokens, hidden, elem, sms, blocks, few) for few in FEW}
                    cases.append((elem, sms, blocks, tokens, hidden, q["auto"][1], q["auto"][2], q["auto"][0][1]))
                    queries += [q[few][0] for few in FEW]
    answers = driver(queries)
    assert len(answers) == len(queries)
    for i, (elem, sms, blocks, tokens, hidden, in_flight, phases, packs) in enumerate(cases):
        fill, narrow, wave = answers[3 * i: 3 * i + 3]
        where = (elem, sms, blocks, tokens, hidden)
        wave_blocks = min(blocks, 4) * sms
        one_step = lambda tx: THREADS // tx * in_flight >= tokens  # noqa: E731
        idle_ok = lambda tx: -(-packs // tx) * tx * 8 <= packs * 9  # noqa: E731
        for t in (wave, fill):
            tx, ty, column_tiles, row_tiles = t
            assert tx * ty == THREADS and ty % phases == 0, where
            assert column_tiles == -(-packs // tx), where
            if tx != narrow[0]:
                assert narrow[3] == 1 and row_tiles == 1 and one_step(tx), where
                assert tx > narrow[0] and tx & (tx - 1) == 0 and idle_ok(tx), where
            else:
                assert t == narrow, where
        if narrow[3] > 1 or narrow[2] <= wave_blocks:
            assert wave == narrow, where
        else:
            tx = wave[0]
            nxt = 2 * tx
            fits = wave[2] <= wave_blocks
            blocked = nxt > THREADS // phases or not one_step(nxt) or not idle_ok(nxt)
            assert fits or blocked, where
            if tx > narrow[0]:  # the width before it still passed the wave
                assert -(-packs // (tx // 2)) > wave_blocks, where
        if fill[0] > narrow[0]:
            assert fill[2] >= max(sms, 1), where
        elif narrow[3] == 1 and one_step(2 * narrow[0]) and 2 * narrow[0] <= THREADS // phases \
                and idle_ok(2 * narrow[0]):
            assert -(-packs // (2 * narrow[0])) < max(sms, 1), where


def test_few_rows_rule_at_the_record(driver):
    """The sweep's 64-token rows on the H200's 132 SMs at 4 blocks an SM (results/nvidia-h200/
    chapter5_pytorch_extensions_shapes.json at e0364aa): float32 64 x 12288, 768 blocks of 64-byte
    tiles (one thread a row, 1.45 waves), becomes 384 of 128-byte tiles (two rows a thread, one
    wave); 64 x 16384, 1024, becomes 512; auto (fill) halves the one-wave grids of two blocks an SM
    or more too (bfloat16 64 x 12288: 384 to 192) but never leaves an SM without one (bfloat16
    64 x 3072 stays 96), where wave keeps their tiling."""
    want = {  # (elem, tokens, hidden): {few: (tx, column_tiles)}
        (4, 64, 12288): {"narrow": (4, 768), "wave": (8, 384), "auto": (8, 384)},
        (4, 64, 16384): {"narrow": (4, 1024), "wave": (8, 512), "auto": (8, 512)},
        (4, 64, 2048): {"narrow": (4, 128), "wave": (4, 128), "auto": (4, 128)},
        (2, 64, 3072): {"narrow": (4, 96), "wave": (4, 96), "auto": (4, 96)},
        (2, 64, 12288): {"narrow": (4, 384), "wave": (4, 384), "auto": (8, 192)},
        (2, 64, 16384): {"narrow": (4, 512), "wave": (4, 512), "auto": (8, 256)},
        (2, 2048, 777): {"narrow": (64, 13), "wave": (64, 13), "auto": (64, 13)},
    }
    for (elem, tokens, hidden), by_few in want.items():
        for few, (tx, column_tiles) in by_few.items():
            # 2048 x 777 here as the single elements' tiling (the launcher's pick for fused_op)
            q, _, _ = shape_query(tokens, hidden, elem, 132, 4, few)
            if hidden == 777:
                q = (tokens, hidden, elem, 8, 132, 1, 4, FEW[few])
            (got,) = driver([q])
            assert (got[0], got[2], got[3]) == (tx, column_tiles, 32 if hidden == 777 else 1), (elem, tokens, hidden,
                                                                                                few, got)


def test_few_rows_knob_values(driver):
    """COURSE_BIAS_GRAD_FEW's values: unset, empty, auto or fill the default (kFill); narrow; wave;
    anything else names none (the launcher then keeps the default)."""
    got = driver([("parse", v) for v in ("-", "auto", "fill", "narrow", "wave", "wide", "Fill")])
    assert [g[0] for g in got] == [0, 0, 0, 1, 2, -1, -1]


@pytest.mark.cuda
def test_fused_op_backward_few_rows(monkeypatch):
    """The backward under each form of the few-rows rule, at 1, 63, 64, 65, 131, 132 and 133 tokens
    (around 64, where one step of the narrow tile stops covering the rows, and around the H100's and
    H200's 132 SMs) of hidden 777, 2048, 4099, 12288 and 16384 (the widened tiles: float32 12288
    and 16384, bfloat16 ones under fill), in every dtype: dx is the float64 reference's bits (each
    element's own gradient, the same in every form), dbias within the bound of float64's column
    sum, autograd through the public op gives the same, and a CUDA graph replayed twice gives the
    eager bits both times."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    import custom_ops
    from test_custom_ops import _away_from_zero, _graph_replays  # the chapter's first suite's helpers
    backward = custom_ops._C.fused_op_backward_raw
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens in (1, 63, 64, 65, 131, 132, 133):
            for hidden in (777, 2048, 4099, 12288, 16384):
                torch.manual_seed(tokens * 7 + hidden)
                shape = (tokens, hidden)
                x = _away_from_zero(shape, dtype=dtype).to("cuda")
                bias = torch.randn(hidden, device="cuda").to(dtype)
                y = custom_ops.fused_op_forward(x, bias, 0.75)
                dy = torch.randn(shape, device="cuda").to(dtype)
                g = torch.where(y.double() > 0, dy.double(), 0.0)
                eps = torch.finfo(dtype).eps
                bound = 2 * eps * g.abs().sum(0) + 4 * eps * g.sum(0).abs() + 1e-6
                dx_ref = (g * 0.75).to(dtype)
                for few in FEW:
                    monkeypatch.setenv(FEW_KNOB, few)
                    where = (few, dtype, shape)
                    dx, dbias = backward(dy, y, 0.75)
                    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0, msg=str(where))
                    assert bool(((dbias.double() - g.sum(0)).abs() <= bound).all()), where
                    xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
                    gx, gb = torch.autograd.grad(custom_ops.fused_op_forward(xg, bg, 0.75), (xg, bg), dy)
                    assert torch.equal(gx, dx) and torch.equal(gb, dbias), where
                    for replay, got in enumerate(_graph_replays(lambda: backward(dy, y, 0.75))):
                        assert torch.equal(got[0], dx) and torch.equal(got[1], dbias), (*where, replay)
    monkeypatch.delenv(FEW_KNOB, raising=False)
