"""Shared by the Trainer / TRL examples: a tiny random Llama-style model, an offline
word-level tokenizer over its vocabulary, and synthetic documents (no network needed)."""

import torch

VOCAB = 256


def tiny_model(attn_implementation, hidden=64, layers=2, heads=4, kv_heads=2, seed=0):
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                      max_position_embeddings=1 << 16, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float()


def tiny_reward_model(attn_implementation, hidden=64, layers=2, heads=4, kv_heads=2, seed=0):
    """The tiny Llama with a one-score sequence-classification head (a reward model); its
    pad token is the tokenizer's, which the head pools past."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                      max_position_embeddings=1 << 16, attention_dropout=0.0, use_cache=False,
                                      num_labels=1, pad_token_id=VOCAB - 2)
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation).float()


def causal_lm_and_tokenizer(path, attn_implementation="ulysses"):
    """The examples' model and tokenizer: a local checkpoint at `path`, else the tiny
    random Llama and the offline tokenizer."""
    if not path:
        return tiny_model(attn_implementation), tiny_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation),
            AutoTokenizer.from_pretrained(path))


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "<eos>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def synthetic_documents(count, min_len, max_len, seed=0):
    """`count` token-id lists of random lengths (a `datasets.Dataset` with `input_ids`)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g)
    return Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB - 2, (int(n),), generator=g).tolist()
                                            for n in lengths]})
