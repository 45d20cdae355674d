"""examples/smollm2/age_tiers_eval.py on a tiny synthetic model: the engines
it builds age a text request as the tier rule says (the measured bytes equal
the predicted ones, FP16 and tiered outputs agree until the first window
ages), the e_l floors put INT2 on the least sensitive layers and the
fewest of them that meet a byte target, the pooled perplexity is the
one of the scored tokens taken as one text, and runs combine only when
their settings agree."""

import json
import math
import os
import sys

import numpy as np
import pytest

mixkv = pytest.importorskip("mixkv")
from mixkv import Precision as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "smollm2"))
import age_tiers_eval as ate  # noqa: E402

VOCAB = 16


class Config:
    num_layers, num_heads, num_kv_heads, head_dim = 3, 2, 1, 64


class TinyModel:
    """q/k/v drawn from (token, position, layer), so every batch row of a step
    gets the same inputs; the logits are a fixed projection of the attention
    outputs, so any difference in what a cache holds shows in them."""

    config = Config()

    def __init__(self):
        self.proj = np.random.default_rng(7).standard_normal((Config.num_layers * 128, VOCAB)).astype(np.float32)

    def qkv(self, token, position, layer):
        rng = np.random.default_rng([token, position, layer])
        c = self.config
        q = rng.standard_normal((c.num_heads, c.head_dim)).astype(np.float32)
        k = rng.standard_normal((c.num_kv_heads, c.head_dim)).astype(np.float16)
        v = rng.standard_normal((c.num_kv_heads, c.head_dim)).astype(np.float16)
        return q, k, v

    def decode_step(self, ids, positions, attend):
        rows = len(ids)
        outs = []
        for layer in range(self.config.num_layers):
            q, k, v = zip(*(self.qkv(t, p, layer) for t, p in zip(ids, positions)))
            outs.append(attend(layer, np.stack(q), np.stack(k), np.stack(v)).reshape(rows, -1))
        return 10.0 * np.concatenate(outs, axis=1) @ self.proj


def prefill(n):
    rng = np.random.default_rng(1)
    c = Config
    ks = [rng.standard_normal((n, c.num_kv_heads, c.head_dim)).astype(np.float16) for _ in range(c.num_layers)]
    vs = [rng.standard_normal((n, c.num_kv_heads, c.head_dim)).astype(np.float16) for _ in range(c.num_layers)]
    return ks, vs


def test_engines_age_as_the_rule_predicts():
    model = TinyModel()
    n0, cont = 150, [int(x) for x in np.random.default_rng(2).integers(0, VOCAB, 121)]
    bytes_of = ate.block_bytes(Config.num_kv_heads, Config.head_dim)
    errors = [0.3, 0.1, 0.2]
    variants = [
        ate.Variant("FP16"),
        ate.Variant("INT4 (prompt)", prompt_precision=P.INT4),
        ate.Variant("tiers, INT4 floor", floors=[P.INT4] * 3),
        ate.Variant("tiers, one INT2", floors=ate.tier_floors(errors, 1)),
    ]
    assert variants[3].floors == [P.INT4, P.INT2, P.INT4]
    ks, vs = prefill(n0)
    rec = ate.run_request(model, variants, list(range(n0)), cont, ks, vs)
    tokens = n0 + len(cont) - 1
    blocks = math.ceil(tokens / ate.WINDOW)
    assert rec[0]["bytes"][-1] == blocks * Config.num_layers * bytes_of[P.FP16]
    for r, var in zip(rec[2:], variants[2:]):
        assert r["bytes"][-1] / rec[0]["bytes"][-1] == pytest.approx(ate.predicted_ratio(tokens, var.floors, bytes_of))
    # Block 1 (positions 32-63) is the first to age: once 128 tokens follow it,
    # at the step that starts with 192 tokens (t = 42). Until then the tiered
    # engines hold FP16's bytes and give its outputs.
    first_old = 192 - n0
    for r in rec[2:]:
        np.testing.assert_array_equal(r["logp"][:first_old], rec[0]["logp"][:first_old])
        assert r["logp"][first_old:] != rec[0]["logp"][first_old:]
        assert r["bytes"][first_old - 1] == rec[0]["bytes"][first_old - 1]
        assert r["bytes"][first_old] < rec[0]["bytes"][first_old]
        assert r["age_demotions"] > 0
    assert rec[1]["logp"][0] != rec[0]["logp"][0] and rec[1]["age_demotions"] == 0
    assert rec[3]["bytes"][-1] < rec[2]["bytes"][-1] < rec[0]["bytes"][-1]
    scored = ate.score(variants, rec)
    assert scored["FP16"]["top1_agreement"] == 1.0 and scored["FP16"]["bytes_ratio_end"] == 1.0
    assert scored["tiers, INT4 floor"]["scored_tokens"] == len(cont) - 1


def test_fewest_int2_layers_that_meet_the_target():
    bytes_of = ate.block_bytes(3, 64)
    errors = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert ate.tier_floors(errors, 2) == [P.INT4, P.INT2, P.INT4, P.INT2, P.INT4]
    tokens = 3000
    ratios = [ate.predicted_ratio(tokens, ate.tier_floors(errors, k), bytes_of) for k in range(6)]
    assert all(a > b for a, b in zip(ratios, ratios[1:]))
    k = ate.int2_layers_for((ratios[2] + ratios[3]) / 2, tokens, errors, bytes_of)
    assert k == 3
    assert ate.int2_layers_for(ratios[0], tokens, errors, bytes_of) == 0
    assert ate.int2_layers_for(0.01, tokens, errors, bytes_of) == 5  # unreachable: every layer INT2


def test_pooled_is_one_text():
    def item(fp16_nll, tier_nll, tokens, ratio):
        row = {"scored_tokens": tokens, "top1_agreement": 1.0}
        return {
            "variants": {
                "FP16": {**row, "nll_sum": fp16_nll, "ppl": math.exp(fp16_nll / tokens), "bytes_ratio_end": 1.0},
                "t": {**row, "nll_sum": tier_nll, "ppl": math.exp(tier_nll / tokens), "bytes_ratio_end": ratio},
            }
        }

    out = ate.pooled([item(10.0, 11.0, 10, 0.3), item(30.0, 30.0, 30, 0.2)], ["FP16", "t"])
    t = out["variants"]["t"]
    assert out["scored_tokens"] == 40
    assert t["vs_fp16"] == pytest.approx(math.exp(41.0 / 40) / math.exp(40.0 / 40) - 1.0)
    assert t["bytes_ratio"] == pytest.approx(0.225) and (t["bytes_ratio_min"], t["bytes_ratio_max"]) == (0.2, 0.3)
    assert t["within_2pct"] == 1


def test_combine_takes_each_request_once_and_refuses_other_settings(tmp_path):
    def request(label, nll):
        row = {"scored_tokens": 10, "top1_agreement": 1.0, "nll_sum": nll, "ppl": math.exp(nll / 10)}
        return {
            "label": label,
            "prompt_tokens": 100,
            "variants": {"FP16": {**row, "bytes_ratio_end": 1.0}, "t": {**row, "bytes_ratio_end": 0.3}},
        }

    a = {"int2_layers_per_target": {"0.3": 10}, "requests": [request("first question", 10.0)]}
    b = {
        "int2_layers_per_target": {"0.3": 10},
        "requests": [request("first question", 10.0), request("document continuation", 20.0)],
    }
    paths = []
    for name, part in (("a", a), ("b", b)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(part, f)
    out = ate.main(["--combine", *paths, "--continuation", "5", "--json", str(tmp_path / "out.json")])
    assert [it["label"] for it in out["requests"]] == ["first question", "document continuation"]
    assert [g["requests"] for g in out["groups"]] == [1, 1]
    b["int2_layers_per_target"] = {"0.3": 11}
    with open(paths[1], "w") as f:
        json.dump(b, f)
    with pytest.raises(SystemExit, match="different settings"):
        ate.main(["--combine", *paths])
