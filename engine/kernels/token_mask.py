"""A grammar's token mask applied to a card's logits in one launch (engine/pipeline/constrain.py).

The matcher writes the allowed tokens as bits, 32 to a word; unpacking them with torch took about seven launches
a token (shift, and, view, cast, fill, copy, masked_fill), each a few microseconds on a decode step of ~3 ms. Here
one program per block of the vocabulary reads each row's words and writes -inf where a bit is clear or the row is
past the grammar's vocabulary (a padded output head)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _mask_kernel(logits_ptr, words_ptr, V, N_VOCAB, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < V
    w = tl.load(words_ptr + i // 32, mask=inside & (i < N_VOCAB), other=0)
    allowed = ((w >> (i % 32)) & 1) != 0
    tl.store(logits_ptr + i, float("-inf"), mask=inside & ~allowed)


def apply_token_mask_(logits: torch.Tensor, words: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """logits [V] float32 (contiguous, on a card), words int32 [ceil(n_vocab / 32)] on the same card: every row
    whose bit is clear, or at n_vocab and past it, set to -inf in place -> logits."""
    v = logits.shape[-1]
    block = 1024
    _mask_kernel[(triton.cdiv(v, block),)](logits, words, v, n_vocab, BLOCK=block)
    return logits
