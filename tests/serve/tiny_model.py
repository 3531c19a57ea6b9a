"""A tiny random Llama + word-level tokenizer saved with save_pretrained (no hub access)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = ("the a an of to and in is was for on with as by at from it that this be are or not "
         "hello world cat dog sat mat red blue green one two three four five six seven eight "
         "nine ten yes no why how what when where who sky sun moon star tree river city").split()


def build_tiny_llama(directory: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    for i in range(1000 - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>", chat_template=CHAT_TEMPLATE,
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory
