"""Whether a model's keys survive a 4-bit KV cache (--kv q4_0), measured at load on a short text.

Some models' keys carry a few channels far larger than the rest (Qwen2.5's key biases, for one). A channel that is
the same for every key adds the same to every score of a query, which the softmax ignores; what sets keys apart is
the rest. q4_0 scales each block of 32 values by its largest, so in a block holding such a channel the others round
to a step of 1/8 of it and lose what sets them apart. The check writes a short text's keys into a float cache and
compares each layer's q4_0 rounding error with the keys' spread about their mean: on Qwen2.5-Coder-0.5B five of 24
layers had errors of 0.6-1.7 times the spread (its perplexity went from 10.5 to 42.6 with q4_0 keys and values;
llama.cpp's -ctk q4_0 from 33 to 339 on the same text), on Gemma 3 270M every layer stayed below 0.33 (llama.cpp:
42.9 -> 48.3)."""

import logging
from typing import Any

import torch

from engine.layers.kv_cache import dequant4, q4_head_dims_ok, quant4, resolve_kv_type
from engine.models.family_base import scratch_steps

log = logging.getLogger("strata.engine")

Q4_KEY_LIMIT = 0.5  # rounding error over the keys' spread above which a layer's keys are lost in 4 bits
CHECK_TOKENS = 128
CHECK_TEXT = (
    "The river rose for three days after the storm, and the people of the valley carried what they could up the "
    "hill to the old mill. Nobody had kept count of the sacks of grain, so the miller wrote each family's name on "
    "a board and asked them to tally what they brought. By the fourth morning the water had reached the lower "
    "fields, the bridge was gone, and the children were counting boats instead of sheep. In the afternoon a letter "
    "arrived from the town on the far bank: its council offered two barges and a crew if someone could say how many "
    "people still waited and where. The miller read it twice, then climbed onto the roof with a lamp."
)


def q4_key_errors(model: Any, tokenizer: Any) -> dict[int, float]:
    """Each attention layer's q4_0 rounding error of a short text's keys over the keys' spread about their mean
    (norms over tokens, heads and values). The text is read into a float cache as a scratch step: the model's
    caches and expert counts are as before."""
    ids = torch.tensor(tokenizer.encode(CHECK_TEXT)[:CHECK_TOKENS])
    n = int(ids.shape[0])
    cache = model.new_cache(n + 8, resolve_kv_type("auto", model.dtype))
    models = model._models() if hasattr(model, "_models") else [model]  # a split's local stages
    with torch.inference_mode(), scratch_steps(models, []):
        model.forward(ids, cache, 0, last_only=True)
        out = {}
        for i, lk in sorted(getattr(cache, "layers", {}).items()):
            k = lk.k[:n].float()
            if not q4_head_dims_ok(k.shape[-1]):  # heads a q4_0 cache refuses anyway
                continue
            codes, scales = quant4(k)
            err = (dequant4(codes, scales, torch.float32) - k).norm()
            spread = (k - k.mean(0, keepdim=True)).norm().clamp_min(1e-12)
            out[i] = float(err / spread)
    return out


def check_q4_keys(model: Any, tokenizer: Any) -> dict[int, float]:
    """Log whether --kv q4_0 keeps this model's keys (q4_key_errors against Q4_KEY_LIMIT): a warning with the way
    out where some layer loses them. A split with a remote stage is not checked (its worker's layers would count a
    scratch text in their expert counts)."""
    if any(hasattr(s, "ensure") for s in getattr(model, "stages", ())):
        log.info("--kv q4_0: the keys' check runs on a model without a remote stage; not checked here")
        return {}
    errors = q4_key_errors(model, tokenizer)
    if not errors:
        return errors
    worst = max(errors, key=errors.__getitem__)
    lost = sorted(i for i, e in errors.items() if e > Q4_KEY_LIMIT)
    if lost:
        log.warning(
            "--kv q4_0 loses this model's keys: 4-bit blocks round layer %d's keys with an error %.2f times what "
            "sets them apart (%d of %d layers above %.1f: channels far larger than the rest), so its answers will "
            "be worse; --kv int8 keeps them in half of bf16's bytes",
            worst, errors[worst], len(lost), len(errors), Q4_KEY_LIMIT,
        )  # fmt: skip
    else:
        log.info(
            "--kv q4_0: the keys' rounding error is at most %.2f of their spread (layer %d; above %.1f they are lost)",
            errors[worst], worst, Q4_KEY_LIMIT,
        )  # fmt: skip
    return errors
