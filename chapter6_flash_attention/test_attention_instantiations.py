"""The tensor-core rungs' instantiation files (csrc/attention/instantiations/) are exactly what
csrc/attention/generate_instantiations.py writes from attention.h's head-dim lists: a head dim
added to the list without rerunning the generator fails here, with the command that fixes it.
Pure Python: no extension, no GPU."""
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "csrc" / "attention" / "generate_instantiations.py"


def generator():
    spec = importlib.util.spec_from_file_location("generate_instantiations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_instantiations_are_what_the_generator_writes():
    gen = generator()
    changed, stale = gen.differences()
    assert not changed and not stale, (
        f"csrc/attention/instantiations/ is out of date (differs or missing: {changed}; not generated: "
        f"{stale}): run `{gen.COMMAND}` in chapter6_flash_attention and commit the result")


def test_one_file_per_pass_dtype_and_head_dim():
    gen = generator()
    text = gen.HEADER.read_text()
    forward, backward = gen.int_list(text, "kCudaHeadDims"), gen.int_list(text, "kMmaBackwardHeadDims")
    assert forward and set(backward) <= set(forward)  # the backward takes a subset of the forward's
    names = list(gen.expected_files())
    assert names == ([f"flash_fwd_{t}_hdim{d}.cu" for t in ("bf16", "fp16") for d in forward]
                     + [f"flash_bwd_{t}_hdim{d}.cu" for t in ("bf16", "fp16") for d in backward])
    # Every MmaForward rung is instantiated in each forward file.
    rungs = gen.enum_values(text, "MmaForward")
    assert "kSplitKv" in rungs
    d = forward[0]
    fwd = gen.expected_files()[f"flash_fwd_bf16_hdim{d}.cu"]
    assert all(f"run_flash_fwd<__nv_bfloat16, {d}, MmaForward::{r}>(" in fwd for r in rungs)


def test_a_new_head_dim_is_one_edit_of_the_list(tmp_path):
    """What adding a head dim takes: the list in attention.h. The generator then writes its files
    (and the build's glob in sources.py picks them up), and deletes the files of a dim removed."""
    gen = generator()
    text = gen.HEADER.read_text().replace("kCudaHeadDims[] = {", "kCudaHeadDims[] = {160, ", 1)
    assert 160 in gen.int_list(text, "kCudaHeadDims")
    files = gen.expected_files(text)
    assert {"flash_fwd_bf16_hdim160.cu", "flash_fwd_fp16_hdim160.cu"} <= set(files)
    assert "flash_bwd_bf16_hdim160.cu" not in files  # the backward has its own list
    (tmp_path / "flash_fwd_bf16_hdim48.cu").write_text("// a head dim since removed\n")
    gen.HEADER = tmp_path / "attention.h"
    gen.HEADER.write_text(text)
    changed, stale = gen.write(tmp_path)
    assert len(changed) == len(files) and stale == ["flash_fwd_bf16_hdim48.cu"]
    assert sorted(p.name for p in tmp_path.glob("*.cu")) == sorted(files)
    assert gen.differences(tmp_path) == ([], [])
