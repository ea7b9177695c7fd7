"""Incremental detokenisation: text caught up later, several tokens at once, equals text decoded after every token."""
import random

from gpu_target.loader import load_tokenizer
from hetero.detokenizer import catch_up, decode_new_text, init_state


def test_catching_up_gives_the_text_of_decoding_after_every_token(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    rng = random.Random(0)
    held_back = 0
    for _ in range(20):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 8))]
        tokens = list(prompt)
        eager, late = init_state(prompt), init_state(prompt)
        for _ in range(rng.randint(1, 6)):  # a step appends a few tokens (an accepted draft path)
            for _ in range(rng.randint(1, 5)):
                tokens.append(rng.randrange(tokenizer.vocab_size))
                decode_new_text(tokenizer, tokens, eager, skip_special_tokens=True)
                held_back += eager.read_offset < len(tokens)
            catch_up(tokenizer, tokens, late, skip_special_tokens=True)
            assert late == eager
    assert held_back  # some tokens ended in an incomplete character and held their text back
