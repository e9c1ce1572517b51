import pytest

from ibedl.core.prompt import MCQuestion, format_prompt, option_letters, option_token_ids


def test_plain_template_layout():
    q = MCQuestion("What is 2+2?", ("3", "4"), context="Arithmetic.")
    assert format_prompt(q) == "Arithmetic.\n\nQuestion: What is 2+2?\nA. 3\nB. 4\nAnswer:"


def test_chat_template_needs_tokenizer():
    with pytest.raises(ValueError, match="chat-v1"):
        format_prompt(MCQuestion("q", ("a", "b")), "chat-v1")


def test_unknown_template():
    with pytest.raises(ValueError, match="template must be one of .* got 'x'"):
        format_prompt(MCQuestion("q", ("a", "b")), "x")


@pytest.mark.parametrize("n", [1, 27])
def test_option_count_limits(n):
    with pytest.raises(ValueError, match=f"2..26 options, got {n}"):
        MCQuestion("q", tuple("o" * n))
    with pytest.raises(ValueError, match=f"num_options must be in 2..26, got {n}"):
        option_letters(n)


def test_answer_checked():
    with pytest.raises(ValueError, match="answer must be an option index in 0..1, got 2"):
        MCQuestion("q", ("a", "b"), answer=2)


def test_option_ids_single_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = option_token_ids(tok, 26)
    assert len(set(ids)) == 26
    assert [tok.decode([i]) for i in ids[:3]] == [" A", " B", " C"]


def test_multi_token_letter_fails_loudly():
    class Splitting:
        def encode(self, text, add_special_tokens=False):
            return [1, 2] if text == " C" else [ord(text[-1])]

    with pytest.raises(ValueError, match="option letter 'C' .* is 2 tokens"):
        option_token_ids(Splitting(), 4)
