"""The generic split: how a layer feeds its attention, the traits read from its attention call, and the check that
refuses a layer the split does not reproduce."""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, Olmo2Config, Olmo2ForCausalLM
from transformers.models.llama import modeling_llama

from hf_memo.patches.layer_split import GenericSplit, LayerArguments, find_anatomy
from tests.conftest import TINY_LAYOUT, build_model


def _layer_call(model, rows: int = 6):
    """``(layer 0, its forward, its arguments, x (2, rows, 32))`` as the backbone would call it."""
    torch.manual_seed(0)
    x = torch.randn(2, rows, 32, dtype=torch.float64)
    backbone = model.model
    embeddings = backbone.rotary_emb(x, torch.arange(rows)[None])
    return backbone.layers[0], backbone.layers[0].forward, LayerArguments({"position_embeddings": embeddings}), x


def _anatomy(model):
    layer, inner, arguments, x = _layer_call(model)
    return layer, find_anatomy(layer, inner, arguments, x, model.config.model_type)


def test_a_pre_norm_layer_feeds_its_attention_from_its_input_norm_alone():
    layer, anatomy = _anatomy(build_model("llama"))
    assert anatomy.attention_input is layer.input_layernorm and anatomy.skip_input and not anatomy.own_tail
    assert anatomy.traits.scale == 8**-0.5 and anatomy.traits.plain


def test_a_post_norm_layer_feeds_its_attention_its_input():
    torch.manual_seed(0)
    _, anatomy = _anatomy(Olmo2ForCausalLM(Olmo2Config(**TINY_LAYOUT)).double())
    assert anatomy.attention_input is None and not anatomy.skip_input and not anatomy.own_tail


def test_a_parallel_layer_shares_its_input_norm_between_attention_and_mlp():
    torch.manual_seed(0)
    layer, anatomy = _anatomy(CohereForCausalLM(CohereConfig(**TINY_LAYOUT)).double())
    assert anatomy.attention_input is layer.input_layernorm and not anatomy.skip_input


def test_the_split_reproduces_the_layer_on_every_row():
    model = build_model("llama")
    layer, inner, arguments, x = _layer_call(model, rows=9)
    split = GenericSplit(layer, inner, arguments, find_anatomy(layer, inner, arguments, x, "llama"))
    q, k, v = split.project(x, 0, 9)
    assert q.shape == (2, 4, 9, 8) and k.shape == v.shape == (2, 2, 9, 8)
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    got = split.finish(x, out.transpose(1, 2).reshape(2, 9, -1), 0)
    want = layer(x, position_embeddings=arguments.arguments["position_embeddings"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class _ScaledAttention(modeling_llama.LlamaAttention):
    """An attention that does more after its output projection than project it: its own code finishes it."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 2 * out, weights


class _MixingAttention(modeling_llama.LlamaAttention):
    """An attention whose output rows mix after the interface: no finish of some rows reproduces it."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out + out.mean(dim=1, keepdim=True), weights


class _AskingAttention(modeling_llama.LlamaAttention):
    """An attention that asks the attention interface for something the memo core does not compute."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        return super().forward(hidden_states, position_embeddings, attention_mask, chunk_size=4, **kwargs)


class _ScanningAttention(modeling_llama.LlamaAttention):
    """An attention that mixes the tokens before projecting them (as a state-space mixer would)."""

    def forward(self, hidden_states, *args, **kwargs):
        return super().forward(hidden_states.cumsum(dim=1), *args, **kwargs)


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        (_ScanningAttention, "queries, keys and values from more than each token's own row"),
        (_MixingAttention, "differs from its own forward"),
        (_AskingAttention, "asks the attention interface for chunk_size"),
    ],
)
def test_a_layer_the_split_does_not_reproduce_is_refused(attention, message):
    with pytest.raises(ValueError, match=message):
        _anatomy(_with_attention(attention))


def _with_attention(attention):
    model = build_model("llama")
    layer = model.model.layers[0]
    replacement = attention(model.config, 0).double()
    replacement.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = replacement
    return model


def test_an_attention_that_does_more_than_project_its_output_is_finished_by_its_own_code():
    layer, inner, arguments, x = _layer_call(_with_attention(_ScaledAttention), rows=9)
    split = GenericSplit(layer, inner, arguments, find_anatomy(layer, inner, arguments, x, "llama"))
    assert split.anatomy.own_tail and split.anatomy.skip_input is False
    q, k, v = split.project(x, 0, 9)
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    ).transpose(1, 2)
    o = out.reshape(2, 9, -1)
    got = torch.cat([split.finish(x[:, :4], o[:, :4], 0), split.finish(x[:, 4:], o[:, 4:], 4)], dim=1)
    want = layer(x, position_embeddings=arguments.arguments["position_embeddings"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _differential_layer_call(rows: int = 9):
    """DiffLlama's layer 0 (its attention calls the interface twice, with the same queries and keys and each half
    of its values), its forward, arguments and ``x``."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(DiffLlamaConfig(**TINY_LAYOUT)).double()
    return _layer_call(model, rows)


def test_an_attention_calling_the_interface_twice_is_split_with_both_values_side_by_side():
    layer, inner, arguments, x = _differential_layer_call()
    split = GenericSplit(layer, inner, arguments, find_anatomy(layer, inner, arguments, x, "diffllama"))
    assert split.anatomy.calls == 2 and split.anatomy.own_tail
    q, k, v = split.project(x, 0, 9)
    assert v.shape[-1] == 2 * q.shape[-1]  # each call's values, (B, h_kv, s, D) each
    groups = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * split.traits.scale
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -torch.inf)
    o = (scores.softmax(-1) @ v.repeat_interleave(groups, 1)).transpose(1, 2).reshape(2, 9, -1)
    got = torch.cat([split.finish(x[:, :4], o[:, :4], 0), split.finish(x[:, 4:], o[:, 4:], 4)], dim=1)
    want = layer(x, position_embeddings=arguments.arguments["position_embeddings"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_attention_calling_the_interface_twice_with_other_keys_is_refused():
    layer, inner, arguments, x = _differential_layer_call()
    anatomy = find_anatomy(layer, inner, arguments, x, "diffllama")

    def twice(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):  # its keys projected anew
        from transformers.models.diffllama import modeling_diffllama

        interface = modeling_diffllama.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k1, k2 = (self.k_proj(hidden_states).view(shape).transpose(1, 2) for _ in "12")
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        first, _ = interface(self, q, k1, v, attention_mask, scaling=self.scaling)
        second, _ = interface(self, q, k2, v, attention_mask, scaling=self.scaling)
        return self.o_proj(torch.cat([first, second], -1)[..., : first.shape[-1]].flatten(-2)), None

    layer.self_attn.forward = twice.__get__(layer.self_attn)
    with pytest.raises(ValueError, match="calls the attention interface 2 times with other queries, keys"):
        GenericSplit(layer, inner, arguments, anatomy).project(x, 0, 9)


def _falcon_layer_call(rows: int = 9, **fields):
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, **fields)
    model = FalconForCausalLM(config).double()
    x = torch.randn(2, rows, 32, dtype=torch.float64)
    backbone = model.transformer
    embeddings = backbone.rotary_emb(x, torch.arange(rows)[None])
    arguments = {"position_embeddings": embeddings, "alibi": None, "attention_mask": None}
    return backbone.h[0], backbone.h[0].forward, LayerArguments(arguments), x


def test_an_attention_that_calls_torch_sdpa_itself_is_split_at_that_call():
    """Falcon's attention never calls the interface: it calls torch's SDPA under the "sdpa" name it branches on,
    takes the mask as a required argument and returns (hidden states, None)."""
    layer, inner, arguments, x = _falcon_layer_call()
    split = GenericSplit(layer, inner, arguments, find_anatomy(layer, inner, arguments, x, "falcon"))
    assert split.anatomy.direct and split.anatomy.outputs == 2
    q, k, v = split.project(x, 0, 9)
    assert q.shape == (2, 4, 9, 8) and k.shape == v.shape == (2, 1, 9, 8)  # multi-query: one key/value head
    o = torch.nn.functional.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
    o = o.transpose(1, 2).reshape(2, 9, -1)
    got = torch.cat([split.finish(x[:, :4], o[:, :4], 0), split.finish(x[:, 4:], o[:, 4:], 4)], dim=1)
    mask = torch.zeros(9, 9, dtype=torch.float64).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -torch.inf)
    want = layer(
        x, alibi=None, attention_mask=mask[None, None], position_embeddings=arguments.arguments["position_embeddings"]
    )
    torch.testing.assert_close(got, want[0], rtol=1e-12, atol=1e-12)


def test_a_layer_with_alibi_is_refused_for_its_positional_bias():
    layer, inner, _, x = _falcon_layer_call(alibi=True)
    alibi = torch.zeros(2 * 4, 1, 9, dtype=torch.float64)
    with pytest.raises(ValueError, match="FalconDecoderLayer adds a positional bias to its attention scores .'alibi'"):
        find_anatomy(layer, inner, LayerArguments({"alibi": alibi, "attention_mask": None}), x, "falcon")


def test_arguments_needing_a_gradient_are_named_wherever_they_nest():
    table = torch.randn(1, 6, 8, dtype=torch.float64)
    trained = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    arguments = LayerArguments(
        {
            "position_embeddings": (table, table),
            "position_ids": torch.arange(6)[None],
            "attention_mask": trained,  # dropped: hf_memo attends by the step's layout
            "per_layer_input": trained * 2,
            "extra": {"nested": [None, trained]},
        },
        6,
    )
    assert arguments.needing_gradient() == ["per_layer_input", "extra"]
    assert LayerArguments({"position_embeddings": (table, table)}, 6).needing_gradient() == []
