"""`xmoe eval quality` on a tiny random Mixtral and its EXL3 pack: the decoded weights land where the pack's
keys say, restoring gives back the source exactly, and the KL/perplexity arithmetic matches a direct one."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
from checkpoints import SERVE_BASE, save_hf, save_word_tokenizer  # noqa: E402

from xmoe.bench import quality  # noqa: E402
from xmoe.format import decode_weight, load_layer  # noqa: E402
from xmoe.quant.convert import convert  # noqa: E402
from xmoe.quant.plan import ConvertOptions  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    src = save_hf("mixtral", root / "src", base={**SERVE_BASE, "num_hidden_layers": 2})
    save_word_tokenizer(src, SERVE_BASE["vocab_size"])
    dst = root / "pack"
    convert(src, dst, ConvertOptions(bits=2, codebook="mcg", encoder="beam", beam_width=8,
                                         keep=(r"experts\.[123]\.",)), ["cpu"])
    text = root / "text.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"t{int(i)}" for i in torch.randint(3, 256, (400,), generator=g)))
    return src, dst, text


def test_swap_writes_decoded_weights_and_restore_undoes_it(pack):
    from transformers import AutoModelForCausalLM
    src, dst, _ = pack
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = quality.pack_layers(dst)
    assert len(layers) == 2 * 3 and {i for _, i in layers.values()} == {0, 1}
    saved = quality.swap(model, layers, list(layers))
    for key in ("model.layers.1.block_sparse_moe.experts.0.w1", "model.layers.1.block_sparse_moe.experts.0.w3",
                "model.layers.0.block_sparse_moe.experts.0.w2"):
        w = decode_weight(load_layer(layers[key][0], key))
        param, idx = quality.weight_slot(model, key)
        got = param.data[idx]
        assert torch.equal(got, w[: got.shape[1], : got.shape[0]].T), key
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted({f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                      for p in ("gate_up_proj", "down_proj")})
    quality.restore(model, saved)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_compare_matches_direct_arithmetic():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(2, 5, 11, generator=g), -1)
    got = torch.log_softmax(torch.randn(2, 5, 11, generator=g), -1)
    windows = torch.randint(0, 11, (2, 6), generator=g)
    s = quality.compare(ref, got, windows)
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1)
    assert s["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-5)
    nll = -got.gather(-1, windows[:, 1:, None]).mean()
    assert s["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    same = quality.compare(ref, ref, windows)
    assert same["kl_mean"] == pytest.approx(0, abs=1e-6) and same["top1_agreement"] == 1.0
    assert same["ppl"] == pytest.approx(same["ppl_reference"])


def test_evaluate_pack_with_groups(pack, capsys):
    src, dst, text = pack
    opts = quality.QualityOptions(text=str(text), tokens=384, window=128, groups=2)
    r = quality.evaluate(str(dst), str(src), opts)
    assert r["tokens_scored"] == 3 * 127 and len(r["kl_per_token"]) == 3 * 127
    assert [g["group"] for g in r["groups"]] == ["layers 0-0", "layers 1-1"]
    assert r["kl_mean"] > 0 and all(g["kl_mean"] > 0 for g in r["groups"])
    assert 1 < r["ppl_reference"] < 1e4 and 1 < r["ppl"] < 1e4 and 0 <= r["top1_agreement"] <= 1
    names = [row["swapped"] for row in quality.rows(r)]
    assert names[-2:] == ["all (the pack)", "none (reference)"]


def test_evaluate_errors(pack, tmp_path):
    src, dst, text = pack
    with pytest.raises(ValueError, match="no EXL3 tensors"):
        quality.evaluate(str(src), str(src), quality.QualityOptions(text=str(text), tokens=256, window=128))
    with pytest.raises(ValueError, match="fewer than"):
        quality.evaluate(str(dst), str(src), quality.QualityOptions(text=str(text), tokens=100000, window=128))


def test_served_kl_on_hand_made_distributions():
    from xmoe.bench.served_quality import position_kl
    p = [0.5, 0.3, 0.1]                       # listed; the other 0.1 is spread elsewhere
    q = [0.4, 0.4, 0.05]
    ref = {i: math.log(v) for i, v in enumerate(p)} | {-1: math.log(0.1)}
    got = {i: math.log(v) for i, v in enumerate(q)} | {-1: math.log(0.05)}
    want = sum(a * math.log(a / b) for a, b in zip(p + [0.1], q + [0.15]))
    assert position_kl(ref, got) == (pytest.approx(want), pytest.approx(0.9))
    # token 2 not listed by the pack: it joins the rest bucket (0.2 against 0.2)
    part = {0: math.log(0.4), 1: math.log(0.4), -1: math.log(0.4)}
    want = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert position_kl(ref, part) == (pytest.approx(want), pytest.approx(0.8))
    # a lower bound of the full KL, for full distributions cut to their top 3
    full_p, full_q = [0.5, 0.3, 0.1, 0.06, 0.04], [0.4, 0.4, 0.05, 0.05, 0.1]
    exact = sum(a * math.log(a / b) for a, b in zip(full_p, full_q))
    assert position_kl(ref, got)[0] <= exact
    assert position_kl(ref, ref) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.9))
