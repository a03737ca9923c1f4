"""Tiny Hugging Face models built from configs (no downloads), with example inputs and a loss,
for the drop-in tests: each builds in well under a second."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 1000


def ids(shape=(2, 12), seed=0, vocab=VOCAB):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _text(cls, config_cls, **config):
    def build():
        return cls(config_cls(vocab_size=VOCAB, **config))

    x = ids()
    return build, {"input_ids": x}, lambda logits: logits.float().square().mean()


def bert(layers: int = 2):
    return _text(tf.BertForMaskedLM, tf.BertConfig, hidden_size=64, num_hidden_layers=layers,
                 num_attention_heads=2, intermediate_size=256, max_position_embeddings=64)


def roberta():
    return _text(tf.RobertaForMaskedLM, tf.RobertaConfig, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=256, max_position_embeddings=66,
                 pad_token_id=1)


def gpt2(layers: int = 2):
    return _text(tf.GPT2LMHeadModel, tf.GPT2Config, n_embd=64, n_layer=layers, n_head=2,
                 n_positions=64, bos_token_id=0, eos_token_id=0)


def llama():
    return _text(tf.LlamaForCausalLM, tf.LlamaConfig, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                 max_position_embeddings=64, tie_word_embeddings=True)


def qwen2():
    return _text(tf.Qwen2ForCausalLM, tf.Qwen2Config, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                 max_position_embeddings=64)


def t5():
    def build():
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4,
            decoder_start_token_id=0))

    inputs = {"input_ids": ids(), "decoder_input_ids": ids((2, 6), seed=1)}
    return build, inputs, lambda logits: logits.float().square().mean()


def vit():
    def build():
        return tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
            image_size=32, patch_size=8, num_labels=3))

    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return build, {"pixel_values": pixels}, lambda logits: logits.float().square().mean()


HF_MODELS = {"bert": bert, "roberta": roberta, "gpt2": gpt2, "llama": llama, "qwen2": qwen2,
             "t5": t5, "vit": vit}
