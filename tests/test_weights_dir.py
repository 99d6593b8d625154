"""Goldens from a model checkpoint directory in the released layout (``--weights DIR``), the
released ``config.json`` as a config, and what a golden records about its weights
(``--no-weights``, ``replay --weights``).

The expected values: the reference's own run on ``tests/data/ckpt_mixed_s5`` (copied unchanged
from the reference goldens); for test-made checkpoints, a golden whose weights are the
checkpoint's values dequantized here with numpy and ml_dtypes and handed to the plan directly.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn
from safetensors import safe_open

from helpers import DATA
from ds41numba import AttnConfig, preset, weight_specs
from ds41numba.cli import main
from ds41numba.golden import GoldenPlan, dequantize_fp8, make_weights, write_golden

CKPT = DATA / "ckpt_mixed_s5"
REF = DATA / "ckpt_mixed_s5_ref.safetensors"
#: The query rows the reference sampled (its step0.layers.{i}.sample.rows).
REF_ROWS = "0,13,27,40,54,67,81,94,108,121,135,148,162,175,189,202"

# Which parameters a test-made checkpoint stores how (the others: BF16, or F32 when f32).
E8M0_SCALED = ("wq_a.weight", "wkv.weight", "indexer.wq_b.weight")
F32_SCALED = ("wq_b.weight", "wo_b.weight")
F32_STORED = ("q_norm.weight",)          # a bf16 parameter stored as F32 (bf16 values)


# =============================================================================== writing a checkpoint


def write_safetensors(path, tensors):
    """A safetensors file of ``{name: (dtype name, array)}`` (float8 as their bytes, uint8)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def quantize(w, e8m0: bool):
    """``(fp8 bytes, scale dtype, scale, dequantized)`` of a bf16-valued weight: 32 x 32 blocks,
    each scaled so its largest magnitude fits e4m3; the dequantized weight made as the fp8-to-bf16
    cast makes it (float32 product, then bf16), with numpy and ml_dtypes."""
    out, inn = w.shape
    bo, bi = -(-out // 32), -(-inn // 32)
    pad = np.zeros((bo * 32, bi * 32), np.float32)
    pad[:out, :inn] = w
    blocks = pad.reshape(bo, 32, bi, 32)
    amax = np.abs(blocks).max(axis=(1, 3))
    amax[amax == 0] = 1.0
    if e8m0:
        e = np.ceil(np.log2(amax / 448.0)).astype(np.int64)
        scale = np.ldexp(np.float32(1.0), e).astype(np.float32)
        stored = ("F8_E8M0", (e + 127).astype(np.uint8))
    else:
        scale = (amax / np.float32(448.0)).astype(np.float32)
        stored = ("F32", scale)
    q = (blocks / scale[:, None, :, None]).astype(float8_e4m3fn)
    deq = (q.astype(np.float32) * scale[:, None, :, None]).astype(bfloat16)
    crop = (slice(0, out), slice(0, inn))
    q = q.reshape(bo * 32, bi * 32)[crop]
    return q.view(np.uint8).copy(), stored, deq.reshape(bo * 32, bi * 32)[crop].copy()


def checkpoint_tensors(cfg, layers, seed=1, prefix=""):
    """``(checkpoint tensors {name: (dtype, array)}, the weights as the stack takes them)`` for
    ``layers``, stored in every way a released checkpoint stores them, plus decoys."""
    tensors, weights = {}, {}
    tensors[prefix + "embed.weight"] = ("BF16", np.ones((10, cfg.dim), bfloat16))
    for i in layers:
        made = make_weights(cfg, [i], seed)
        for name, (shape, kind) in weight_specs(cfg, i).items():
            w, leaf = made.pop(name), name.split(".attn.", 1)[1]
            key = prefix + name
            if leaf in E8M0_SCALED + F32_SCALED:
                q, scale, deq = quantize(w, leaf in E8M0_SCALED)
                tensors[key] = ("F8_E4M3", q)
                tensors[key[:-len("weight")] + "scale"] = scale
                weights[name] = deq
            elif kind == "f32" or leaf in F32_STORED:
                tensors[key] = ("F32", w)
                weights[name] = w
            else:
                tensors[key] = ("BF16", w.astype(bfloat16))
                weights[name] = w
        tensors[f"{prefix}layers.{i}.attn_norm.weight"] = ("BF16", np.ones(cfg.dim, bfloat16))
        tensors[f"{prefix}layers.{i}.ffn.experts.0.w1.weight"] = ("U8", np.zeros((4, 8), np.uint8))
        tensors[f"{prefix}layers.{i}.ffn.experts.0.w1.scale"] = ("F8_E8M0", np.full((4, 1), 127, np.uint8))
    return tensors, weights


def write_checkpoint(directory, cfg, tensors, shards=3, **extra):
    """The released layout: config.json (attention fields plus ``extra``), the shards (tensors
    dealt round-robin) and model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    names = list(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {n: files[k % shards] for k, n in enumerate(names)}
    for f in files:
        write_safetensors(os.path.join(directory, f),
                          {n: tensors[n] for n in names if weight_map[n] == f})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "n_mtp_layers": 0, "dtype": "fp8", "expert_dtype": "fp4",
                   "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                   "quantization_config": {"fmt": "e4m3", "weight_block_size": [32, 32]},
                   "engram_layer_ids": [], **extra}, f)
    return directory


def assert_same_tensors(a, b):
    """Two goldens hold the same tensors, byte for byte (their metadata may differ)."""
    with safe_open(a, "np") as fa, safe_open(b, "np") as fb:
        assert sorted(fa.keys()) == sorted(fb.keys())
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name


def metadata(path):
    with safe_open(path, "np") as f:
        return f.metadata()


# =============================================================================== the released config


def test_the_released_config_json_is_a_config():
    cfg = AttnConfig.from_json(CKPT / "config.json")
    assert cfg == preset("mixed")
    assert cfg.extra["n_mtp_layers"] == 3 and cfg.extra["quantization_config"]["fmt"] == "e4m3"
    assert cfg.extra["engram_layer_ids"] == [] and cfg.extra["vision_n_layers"] == 0
    # n_layers counts the main layers; the 3 draft layers after them take the last 3 ratios
    assert cfg.n_layers == 8 and cfg.draft_layers() == range(5, 8)


def test_a_misspelt_attention_field_in_the_released_config_is_refused():
    data = json.loads((CKPT / "config.json").read_text())
    data["windw_size"] = data.pop("window_size")
    with pytest.raises(ValueError, match="unknown field 'windw_size'; did you mean window_size"):
        AttnConfig.from_dict(data)


def test_more_layers_than_ratios_is_refused():
    data = json.loads((CKPT / "config.json").read_text())
    with pytest.raises(ValueError, match=r"n_layers \(6\) \+ n_mtp_layers \(3\) layers, but "
                                         r"compress_ratios has 8 entries"):
        AttnConfig.from_dict({**data, "n_layers": 6})


# =============================================================================== the reference's run


def test_a_golden_of_the_released_checkpoint_is_the_reference_run(tmp_path, capsys):
    mine = tmp_path / "mine.safetensors"
    assert main(["golden", "--weights", str(CKPT), "--seed", "5", "--prefill", "203",
                 "--decode", "6", "--capture-rows", REF_ROWS, "--out", str(mine), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(REF), str(mine), "--subset", "--exact-index"]) == 0
    text = capsys.readouterr().out
    assert "219 tensors compared" in text and "index rows 3054/3054 identical" in text
    assert "100.000% bit-identical" in text
    recorded = json.loads(metadata(mine)["weights"])
    assert recorded["source"] == "checkpoint directory" and recorded["stored"] is True
    wq = recorded["tensors"]["layers.3.attn.wq_b.weight"]
    assert wq["file"] == "model-00002-of-00003.safetensors" and wq["dtype"] == "F8_E4M3"
    assert wq["scale"]["tensor"] == "layers.3.attn.wq_b.scale" and len(wq["sha256"]) == 64
    # the weights are in the file: it replays without the checkpoint
    assert main(["replay", str(mine), "--quiet", "--exact-index"]) == 0


def test_no_weights_then_replay_with_the_checkpoint(tmp_path, capsys):
    small = tmp_path / "small.safetensors"
    assert main(["golden", "--weights", str(CKPT), "--preset", "mixed", "--seed", "5",
                 "--prefill", "40", "--decode", "2", "--capture", "io", "--no-weights",
                 "--out", str(small), "--quiet"]) == 0
    with safe_open(small, "np") as f:
        assert not [n for n in f.keys() if n.startswith("layers.")]
    assert json.loads(metadata(small)["weights"])["stored"] is False
    capsys.readouterr()
    assert main(["replay", str(small), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "replay it with --weights DIR" in err
    assert main(["replay", str(small), "--quiet", "--weights", str(CKPT), "--exact-index"]) == 0
    # another checkpoint: one byte of one tensor differs
    other = tmp_path / "other"
    shutil.copytree(CKPT, other)
    shard = other / "model-00003-of-00003.safetensors"
    entry = _entry(shard, "layers.2.attn.wq_b.weight")
    data = bytearray(shard.read_bytes())
    data[entry] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["replay", str(small), "--quiet", "--weights", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "layers.2.attn.wq_b.weight in model-00003-of-00003.safetensors" in err
    assert "checksum differs" in err


def _entry(path, name) -> int:
    """The file offset of tensor ``name``'s first byte."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


# =============================================================================== test-made checkpoints


@pytest.mark.parametrize("prefix, capture", [("", "all"), ("model.", "io")])
def test_tiny_checkpoint_is_the_golden_of_its_dequantized_weights(tmp_path, prefix, capture):
    cfg = preset("tiny")
    layers = range(cfg.n_layers)
    tensors, weights = checkpoint_tensors(cfg, layers, prefix=prefix)
    stored = {t[0] for t in tensors.values()}
    assert {"F8_E4M3", "F8_E8M0", "F32", "BF16"} <= stored
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, tensors)
    mine = tmp_path / "mine.safetensors"
    assert main(["golden", "--weights", str(ckpt), "--prefill", "12", "--decode", "5",
                 "--capture", capture, "--capture-rows", "3,13", "--chunk", "5",
                 "--out", str(mine), "--quiet"]) == 0
    given = tmp_path / "given.safetensors"
    write_golden(GoldenPlan(cfg, tuple(layers), 12, 5, capture=capture, capture_rows=(3, 13),
                            weights=weights), given, chunk=5)
    assert_same_tensors(mine, given)
    assert "weights" in metadata(mine) and json.loads(metadata(given)["weights"])["stored"]


def test_v41_flash_layer_20_checkpoint_at_real_shapes(tmp_path):
    """One layer's tensors (the directory holds no other layer), real shapes."""
    cfg = preset("v41-flash")
    tensors, weights = checkpoint_tensors(cfg, [20], seed=2)
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, tensors, n_layers=40, n_mtp_layers=3)
    del tensors
    mine = tmp_path / "mine.safetensors"
    assert main(["golden", "--weights", str(ckpt), "--layers", "20", "--prefill", "40",
                 "--decode", "2", "--capture", "io", "--out", str(mine), "--quiet"]) == 0
    given = tmp_path / "given.safetensors"
    write_golden(GoldenPlan(cfg, (20,), 40, 2, capture="io", weights=weights), given)
    assert_same_tensors(mine, given)


def test_draft_layers_named_as_mtp_blocks(tmp_path):
    """Layers n_layers .. n_layers + n_mtp_layers - 1 may be stored as ``mtp.{k}.attn.*``."""
    cfg = preset("tiny")
    tensors, weights = checkpoint_tensors(cfg, range(cfg.n_layers))
    for key in list(tensors):
        for k, i in enumerate((4, 5)):
            if key.startswith(f"layers.{i}.attn."):
                tensors[f"model.mtp.{k}.attn." + key.split(".attn.", 1)[1]] = tensors.pop(key)
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, tensors, n_layers=4, n_mtp_layers=2)
    mine = tmp_path / "mine.safetensors"
    assert main(["golden", "--weights", str(ckpt), "--prefill", "12", "--decode", "3",
                 "--capture", "io", "--out", str(mine), "--quiet"]) == 0
    given = tmp_path / "given.safetensors"
    write_golden(GoldenPlan(cfg, tuple(range(6)), 12, 3, capture="io", weights=weights), given)
    assert_same_tensors(mine, given)
    recorded = json.loads(metadata(mine)["weights"])["tensors"]
    assert recorded["layers.5.attn.wq_a.weight"]["tensor"] == "model.mtp.1.attn.wq_a.weight"


def test_dequantize_fp8_is_the_cast_of_every_byte_and_scale():
    """Every e4m3 byte (NaN, subnormals, both zeros) times e8m0 scales at both ends and f32
    scales that round, against numpy's float32 product and ml_dtypes' rounding to bf16."""
    rng = np.random.default_rng(0)
    q = np.concatenate([np.arange(256, dtype=np.uint8)] * 16).reshape(64, 64)
    q = np.concatenate([q, rng.integers(0, 256, (33, 64), dtype=np.uint8)])[:, :45]
    for scale in (np.ldexp(np.float32(1.0), rng.integers(-127, 128, (4, 2))).astype(np.float32),
                  rng.random((4, 2)).astype(np.float32) * np.float32(1e-3)):
        full = np.repeat(np.repeat(scale, 32, 0), 32, 1)[:q.shape[0], :q.shape[1]]
        with np.errstate(over="ignore", invalid="ignore"):
            want = (q.view(float8_e4m3fn).astype(np.float32) * full).astype(bfloat16)
        got = dequantize_fp8(q, scale)
        assert got.dtype == bfloat16 and got.shape == q.shape
        same = got.view(np.uint16) == want.view(np.uint16)
        assert (same | (np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))).all()


# =============================================================================== refusals


def _tiny(tmp_path, change=None, **extra):
    cfg = preset("tiny")
    tensors, _ = checkpoint_tensors(cfg, range(cfg.n_layers))
    if change is not None:
        change(tensors)
    return write_checkpoint(tmp_path / "ckpt", cfg, tensors, **extra)


def _set(name, dtype, array):
    def change(tensors):
        tensors[name] = (dtype, array)
    return change


def _drop(name):
    return lambda tensors: tensors.pop(name)


@pytest.mark.parametrize("change, words", [
    (_drop("layers.2.attn.wkv.weight"),
     ["layers.2.attn.wkv.weight", "missing from model.safetensors.index.json"]),
    (_drop("layers.0.attn.wq_a.scale"),
     ["layers.0.attn.wq_a.scale", "the scale of the F8_E4M3 layers.0.attn.wq_a.weight in model-"]),
    (_set("layers.1.attn.wo_a.weight", "BF16", np.zeros((32, 32), bfloat16)),
     ["layers.1.attn.wo_a.weight in model-", "has shape [32, 32]; the config makes it [32, 64]"]),
    (_set("layers.1.attn.kv_norm.weight", "F16", np.ones(32, np.float16)),
     ["layers.1.attn.kv_norm.weight in model-", "is F16"]),
    (_set("layers.1.attn.kv_norm.weight", "F8_E4M3", np.ones(32, np.uint8)),
     ["layers.1.attn.kv_norm.weight in model-", "is F8_E4M3"]),
    (_set("layers.3.attn.wq_a.scale", "F8_E8M0", np.full((1, 1), 127, np.uint8)),
     ["layers.3.attn.wq_a.scale in model-", "has shape [1, 1]", "[1, 2]"]),
    (_set("layers.3.attn.wq_a.scale", "F8_E8M0", np.array([[127, 255]], np.uint8)),
     ["layers.3.attn.wq_a.scale in model-", "NaN or infinite scale"]),
    (_set("layers.3.attn.wq_b.scale", "F32", np.array([[1.0], [np.inf], [1.0], [1.0]], np.float32)),
     ["layers.3.attn.wq_b.scale in model-", "NaN or infinite scale"]),
    (_set("layers.3.attn.wq_b.scale", "BF16", np.ones((4, 1), bfloat16)),
     ["layers.3.attn.wq_b.scale in model-", "is BF16; a block scale is F8_E8M0 or F32"]),
    (_set("layers.4.attn.q_norm.weight", "F32", np.full(16, 1.001, np.float32)),
     ["layers.4.attn.q_norm.weight in model-", "values that are not bf16"]),
])
def test_a_bad_checkpoint_is_one_line_and_nothing_written(tmp_path, capsys, change, words):
    ckpt = _tiny(tmp_path, change)
    _refused(tmp_path, capsys, ["--weights", str(ckpt)], words)


def test_a_shard_the_index_names_but_the_directory_lacks(tmp_path, capsys):
    ckpt = _tiny(tmp_path)
    os.remove(ckpt / "model-00002-of-00003.safetensors")
    _refused(tmp_path, capsys, ["--weights", str(ckpt)],
             ["is in shard model-00002-of-00003.safetensors", "the directory lacks"])


def test_config_and_preset_must_agree_on_every_attention_field(tmp_path, capsys):
    ckpt = _tiny(tmp_path)
    _refused(tmp_path, capsys, ["--weights", str(ckpt), "--preset", "mixed"],
             ["config.json has dim 64, --preset mixed has dim 128"])
    other = dict(preset("tiny").to_dict(), window_size=4)
    (tmp_path / "other.json").write_text(json.dumps(other))
    _refused(tmp_path, capsys, ["--weights", str(ckpt), "--config", str(tmp_path / "other.json")],
             ["config.json has window_size 8", "other.json has window_size 4"])
    # agreeing ones run (extra keys aside)
    out = tmp_path / "out" / "ok.safetensors"
    assert main(["golden", "--weights", str(ckpt), "--preset", "tiny", "--prefill", "4",
                 "--decode", "1", "--capture", "io", "--out", str(out), "--quiet"]) == 0


def test_a_misspelt_field_in_config_json_and_no_weights_alone(tmp_path, capsys):
    ckpt = _tiny(tmp_path, windw_size=3)
    _refused(tmp_path, capsys, ["--weights", str(ckpt)],
             ["config.json", "unknown field 'windw_size'; did you mean window_size?"])
    _refused(tmp_path, capsys, ["--no-weights"], ["--no-weights", "--weights DIR"])
    _refused(tmp_path, capsys, ["--weights", str(tmp_path / "nowhere")], ["is not a directory"])


def _refused(tmp_path, capsys, args, words):
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    capsys.readouterr()
    status = main(["golden", *args, "--prefill", "4", "--decode", "1", "--capture", "io",
                   "--out", str(out_dir / "g.safetensors"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    assert os.listdir(out_dir) == []
