"""central.lm.lean: the lean KV-cached forward computes transformers' Llama function."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from central.lm.lean import LeanLlama, supports
from central.omnidraft.decode import CachedLM
from central.omnidraft.online import add_lora


def _llama(kv_heads: int, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("kv_heads,tie", [(4, True), (2, False)])  # plain and grouped-query attention
def test_chunks_tokens_and_crops_give_transformers_logits_and_last_hidden_state(kv_heads, tie) -> None:
    model = _llama(kv_heads, tie)
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    lean = LeanLlama(model)
    parts = [lean.forward(ids[:70]), lean.forward(ids[70:71]), lean.forward(ids[71:90])]  # 90 > the first buffer (64)
    assert torch.allclose(torch.cat([p[0] for p in parts]), ref.logits[0], atol=1e-10, rtol=0)
    assert torch.allclose(torch.cat([p[1] for p in parts]), ref.hidden_states[-1][0], atol=1e-10, rtol=0)
    lean.crop(30)  # a rejection: the next tokens overwrite positions 30.. of the buffer
    again, _ = lean.forward(ids[30:90])
    assert torch.allclose(again, ref.logits[0, 30:], atol=1e-10, rtol=0)
    changed, _ = LeanLlama(model).forward(ids[:30] + [ids[30] + 1])
    assert not torch.allclose(changed[-1], ref.logits[0, 30])  # the check can fail: another token, other logits


def test_lora_is_folded_in_on_refresh() -> None:
    model = _llama(4)
    add_lora(model, rank=4, alpha=8.0, last_layers=0, gen=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA's B starts at 0; move it so the update is not a no-op
                p.add_(0.05 * torch.randn_like(p))
    ids = list(range(3, 40))
    lean = LeanLlama(model)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(lean.forward(ids)[0], ref, atol=1e-10, rtol=0)


def test_cached_lm_lean_and_transformers_agree_through_crops_and_a_weight_change() -> None:
    model = _llama(2)
    add_lora(model, rank=4, alpha=8.0, last_layers=1, gen=torch.Generator().manual_seed(3))
    lean, plain = CachedLM(model, lean=True), CachedLM(model, lean=False)
    assert lean.lean is not None and plain.lean is None
    for lm in (lean, plain):
        lm.set_ids(list(range(5, 25)))
    assert torch.allclose(lean.forward()[0], plain.forward()[0], atol=1e-10)
    for lm in (lean, plain):  # a rejection: crop to a common prefix, then extend
        lm.set_ids(list(range(5, 18)) + [40, 41, 42])
    assert torch.allclose(lean.forward(hidden=True)[1], plain.forward(hidden=True)[1], atol=1e-10)
    with torch.no_grad():  # a distillation step changes the LoRA weights; invalidate() re-reads them
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    for lm in (lean, plain):
        lm.invalidate()
        lm.append(43)
    assert torch.allclose(lean.forward()[0], plain.forward()[0], atol=1e-10)
    assert lean.calls == plain.calls == 3 and lean.rebuild_seconds > 0


def test_models_it_cannot_reproduce_keep_transformers_forward() -> None:
    assert supports(_llama(4)) and not supports(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LeanLlama(torch.nn.Linear(2, 2))
    assert CachedLM(torch.nn.Identity(), lean=True).lean is None
