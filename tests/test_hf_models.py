"""gyre.real.nn.hf_folder / hf_causal: causal LMs transformers knows, from local folders, behind gyre's model
interface."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gyre.real.nn.hf_causal import CausalLM, build_model  # noqa: E402
from gyre.real.nn.hf_folder import (  # noqa: E402
    ModelFolderError,
    check_dtype,
    check_model_folder,
    load_model,
    spec_mismatch,
    tokenizer_dir,
    write_tiny_model,
)
from gyre.real.nn.kv_cache import KVCache  # noqa: E402

FAMILIES = ("qwen3", "qwen2", "llama")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: write_tiny_model(tmp_path_factory.mktemp(f), f, seed=1) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_loads_as_the_transformers_model(folders, family):
    """CausalLM's logits are transformers' own for the folder's model, bit for bit; names are HF names."""
    _, hf = load_model(folders[family])
    m = CausalLM(hf)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    want = hf(input_ids=ids).logits
    assert torch.equal(m(ids, pos), want), f"{family}: CausalLM logits differ from transformers'"
    names = set(m.serving_state())
    assert "model.embed_tokens.weight" in names and all(n.startswith(("model.", "lm_head.")) for n in names), names
    assert ("lm_head.weight" in names) == (not m.tied), "a tied head's alias is left out of the serving state"
    if family == "qwen3":
        assert any("q_norm" in n for n in names), "Qwen3's per-head q/k norms are parameters of the model"
    if family == "qwen2":
        assert any(n.endswith("q_proj.bias") for n in names), "Qwen2's q/k/v biases are parameters of the model"


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_matches_full_forward(folders, family):
    """prefill + extend + a batched, right-padded decode step give the full forward's logits (fp32, 1e-5)."""
    m = build_model(folders[family])
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    full = m(ids, torch.arange(12)[None])[0]
    logits, cache = m.prefill(ids[:, :7], torch.arange(7)[None])
    assert torch.allclose(logits[0], full[:7], atol=1e-5), "prefill"
    ext = m.extend(ids[:, 7:10], torch.arange(7, 10)[None], cache)
    assert torch.allclose(ext[0], full[7:10], atol=1e-5), "extend"
    _, short = m.prefill(ids[:, :5], torch.arange(5)[None])
    batch = KVCache.concat([short, cache])  # rows of 5 and 10 slots: the short one right-padded, invalid
    out = m.decode_step(torch.stack([ids[0, 5], ids[0, 10]]), torch.tensor([5, 10]), batch)
    assert torch.allclose(out[0], full[5], atol=1e-5) and torch.allclose(out[1], full[10], atol=1e-5), \
        f"batched decode: {(out[0] - full[5]).abs().max():.2e}, {(out[1] - full[10]).abs().max():.2e}"


def test_serving_state_round_trips_bitwise(folders):
    """A serving state loaded into a second model of the folder makes it that model, bit for bit."""
    a, b = build_model(folders["qwen3"]), build_model(folders["qwen3"])
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.5)
    b.load_serving_state(a.serving_state())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert b.lm_head.weight is b.model.embed_tokens.weight, "the tie survives a load"


def test_spec_and_mismatch(folders):
    """check_model_folder reads shapes from headers; two families differ by architecture, one by a shape."""
    q3, ll = check_model_folder(folders["qwen3"]), check_model_folder(folders["llama"])
    assert (q3.architecture, q3.num_layers, q3.num_kv_heads, q3.head_dim) == ("Qwen3ForCausalLM", 2, 2, 16), q3
    assert q3.num_parameters == sum(t.numel() for t in build_model(folders["qwen3"]).serving_state().values())
    assert spec_mismatch(q3, q3) is None
    assert spec_mismatch(q3, ll).startswith("architecture: trained 'Qwen3ForCausalLM'"), spec_mismatch(q3, ll)


def test_tokenizer_dir(folders, tmp_path):
    """A weights-only folder has no tokenizer; one with tokenizer.json is its own tokenizer folder."""
    assert tokenizer_dir(folders["llama"]) is None
    d = tmp_path / "m"
    shutil.copytree(folders["llama"], d)
    (d / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(d) == d.resolve()


def _broken(src, tmp_path, edit):
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    edit(d)
    return d


@pytest.mark.parametrize("edit, says", [
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors weights"),
    (lambda d: (d / "config.json").write_text("{nope"), "config.json: not JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "qwen9"})),
     "model_type = 'qwen9' is not a model type transformers knows"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "vit"})), "model_type = 'vit' is not a causal LM"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "architectures": ["Qwen9ForCausalLM"]})),
     "architectures = ['Qwen9ForCausalLM']: not a class transformers has"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 16), "cannot read the safetensors header"),
])
def test_bad_folder_is_one_line(folders, tmp_path, edit, says):
    """A folder without config.json or weights, or with a model transformers does not know: one line naming it."""
    d = _broken(folders["qwen3"], tmp_path, edit)
    with pytest.raises(ModelFolderError) as err:
        check_model_folder(d)
    msg = str(err.value)
    assert says in msg and str(d) in msg and "\n" not in msg, msg
    with pytest.raises(ModelFolderError):
        check_model_folder(tmp_path / "absent")


def test_bad_dtype_is_one_line():
    """An unknown dtype, or CUDA where there is none, is refused naming the field."""
    with pytest.raises(ModelFolderError, match=r"^trainer\.dtype = 'fp8': expected one of"):
        check_dtype("fp8", field="trainer.dtype")
    if not torch.cuda.is_available():
        with pytest.raises(ModelFolderError, match="has no CUDA here"):
            check_dtype("bfloat16", "cuda")
    assert check_dtype("bfloat16", "cpu") == "bfloat16"
