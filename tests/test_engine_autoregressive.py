"""AutoregressiveEngine over a scripted ArModel: greedy, seeded sampling, end tokens, interrupts."""

from __future__ import annotations

import numpy as np
import pytest

from dgcli.engine.autoregressive import AutoregressiveEngine
from dgcli.engine.types import TokenEvent
from dgcli.errors import DgError, InvalidParameter

VOCAB, EOS = 10, 1


class ScriptedArModel:
    """Next token = (last token + 1) mod VOCAB as the clear favourite; `end_after` tokens then EOS."""

    def __init__(self, end_after=None, interrupt_at=None):
        self.vocab_size, self.end_token_ids = VOCAB, [EOS, 9]
        self.end_after, self.interrupt_at = end_after, interrupt_at
        self.fed: list[int] = []
        self.decodes = 0

    def tokenize(self, text, add_bos=True, special=True):
        return [2] + [3] * len(text)

    def chat_prompt(self, user_text):
        return [2, 4, 4]

    def detokenize(self, ids):
        return "".join(str(t) for t in ids)

    def reset(self):
        self.fed = []

    def _logits(self):
        logits = np.zeros(VOCAB, dtype=np.float32)
        produced = self.decodes
        favourite = EOS if self.end_after is not None and produced >= self.end_after else (self.fed[-1] % 7) + 2
        logits[favourite] = 3.0
        return logits

    def prefill(self, tokens):
        self.fed += list(tokens)
        return self._logits()

    def decode_token(self, token):
        self.decodes += 1
        if self.interrupt_at == self.decodes:
            raise KeyboardInterrupt
        self.fed.append(token)
        return self._logits()


def test_greedy_follows_the_argmax_and_stops_at_max_new_tokens():
    model = ScriptedArModel()
    events = []
    result = AutoregressiveEngine(model).generate([2, 3], max_new_tokens=4, on_event=events.append)
    assert result.token_ids == [5, 7, 2, 4]
    assert result.mode == "autoregressive" and result.stop_reason == "length"
    assert result.decoder_forwards == 4 and result.tokens_per_forward == 1.0
    assert [e.token_id for e in events] == result.token_ids
    assert all(isinstance(e, TokenEvent) for e in events)
    assert model.decodes == 3  # no forward after the last token


def test_end_token_stops_and_is_dropped():
    result = AutoregressiveEngine(ScriptedArModel(end_after=2)).generate([2, 3], max_new_tokens=50)
    assert result.token_ids == [5, 7]
    assert result.stop_reason == "end_token"


def test_sampling_is_seeded_and_differs_from_greedy_somewhere():
    def run(seed):
        return AutoregressiveEngine(ScriptedArModel()).generate([2, 3], max_new_tokens=20, seed=seed,
                                                                 temperature=2.0).token_ids

    assert run(1) == run(1)
    greedy = AutoregressiveEngine(ScriptedArModel()).generate([2, 3], max_new_tokens=20).token_ids
    assert any(run(seed) != greedy for seed in range(3))


def test_interrupt_and_on_event_false_return_what_was_made():
    result = AutoregressiveEngine(ScriptedArModel(interrupt_at=2)).generate([2], max_new_tokens=10)
    assert result.interrupted and result.token_ids == [4, 6]
    result = AutoregressiveEngine(ScriptedArModel()).generate([2], max_new_tokens=10,
                                                              on_event=lambda e: e.index < 2)
    assert result.interrupted and len(result.token_ids) == 3


def test_chat_template_applied_to_text():
    model = ScriptedArModel()
    AutoregressiveEngine(model).generate("hello", max_new_tokens=1)
    assert model.fed[:3] == [2, 4, 4]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=-1.0), InvalidParameter, "temperature=-1.0"),
    (dict(max_new_tokens=0), InvalidParameter, "max_new_tokens=0"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        AutoregressiveEngine(ScriptedArModel()).generate([2], **kwargs)


def test_prompt_outside_vocab():
    with pytest.raises(DgError, match="outside the vocabulary"):
        AutoregressiveEngine(ScriptedArModel()).generate([2, 55])


class SlowDecodeArModel(ScriptedArModel):
    """Every decode takes 20 ms (the prefill nothing), so the mean decode time is known."""

    def decode_token(self, token):
        import time

        time.sleep(0.02)
        return super().decode_token(token)


@pytest.mark.parametrize("end_after, max_new_tokens, decodes", [(None, 1, 0), (None, 4, 3), (2, 50, 2)])
def test_the_mean_decode_time_divides_by_the_decodes_that_ran(end_after, max_new_tokens, decodes):
    # the first token's logits come from the prefill and the last one's forward is skipped at -n: bench's
    # "AR pair decode step" divided the decode time by the tokens, 0.000 ms at -n 1, 3/4 of it at -n 4
    model = SlowDecodeArModel(end_after=end_after)
    result = AutoregressiveEngine(model).generate([2, 3], max_new_tokens=max_new_tokens)
    assert model.decodes == decodes and result.timed_forwards == decodes
    if decodes == 0:
        assert result.mean_forward_s is None
    else:
        assert 0.02 <= result.mean_forward_s < 0.02 * 1.5 + 0.01


def test_the_chat_template_and_tokenizer_are_not_generation_time():
    import time

    class SlowTemplate(ScriptedArModel):
        def chat_prompt(self, user_text):
            time.sleep(0.3)
            return super().chat_prompt(user_text)

    result = AutoregressiveEngine(SlowTemplate(end_after=2)).generate("hi", max_new_tokens=8)
    assert result.token_ids == [6, 8]
    assert result.total_s < 0.3 and result.tokens_per_second > 2 / 0.3


@pytest.mark.parametrize("end_after, max_new_tokens, made", [(None, 1, 0), (None, 2, 1), (None, 4, 3), (1, 50, 0),
                                                             (3, 50, 2)])
def test_tok_s_counts_only_the_tokens_made_after_the_prefill(end_after, max_new_tokens, made):
    # the first token's logits come from the prefill, whose time tok/s leaves out: at -n 1 the rate divided
    # one token by its sampling time (3434 tok/s on the demo), at -n 2 it was twice the decode rate
    result = AutoregressiveEngine(SlowDecodeArModel(end_after=end_after)).generate([2, 3], max_new_tokens=max_new_tokens)
    assert result.prefill_answer_tokens == 1 and result.n_new_tokens == made + 1
    if made == 0:
        assert result.tokens_per_second is None
        assert result.to_json()["tokens_per_second"] is None
    else:
        assert result.tokens_per_second == pytest.approx(made / result.generation_s)
        assert made / (0.02 * result.timed_forwards * 1.5 + 0.01) < result.tokens_per_second <= 1 / 0.02
