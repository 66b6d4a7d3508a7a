"""The scheduler's side of structured outputs (issue 11), with fake grammars: a request
waits while its grammar compiles without holding up the others; a failed compile ends
the request with an output (no hang); the mask travels in the SchedulerOutput; the
grammar advances by the sampled tokens, after the reasoning when there is a parser."""
from concurrent.futures import Future

import numpy as np
from factories import (
    EOS,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    run_step,
)

from jaxserve.config import StructuredOutputsConfig
from jaxserve.request import RequestStatus
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured_output import StructuredOutputManager
from jaxserve.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

V = 100


class ScriptedGrammar(StructuredOutputGrammar):
    """Allows exactly the next token of ``script``; terminated at its end."""

    def __init__(self, script):
        self.script, self.pos, self.accepted = list(script), 0, []

    def accept_tokens(self, token_ids):
        for t in token_ids:
            if self.pos >= len(self.script) or t != self.script[self.pos]:
                return False
            self.pos += 1
            self.accepted.append(t)
        return True

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        t = self.script[self.pos]
        bitmask[row, t // 32] = np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def is_terminated(self):
        return self.pos == len(self.script)

    def rollback(self, num_tokens):
        self.pos -= num_tokens


class GatedBackend(StructuredOutputBackend):
    """compile_grammar returns a grammar only once the test opens the gate."""
    name = "gated"

    def __init__(self):
        self.futures = {}

    def validate(self, params):
        pass

    def compile_grammar(self, params):
        raise AssertionError("the manager's executor is replaced in these tests")


class ReasonerStub:
    end = 99

    def is_reasoning_end(self, ids):
        return self.end in ids


def manager_with(futures, reasoner=None):
    m = StructuredOutputManager(StructuredOutputsConfig(backend="guidance"), tokenizer=None, vocab_size=V)
    m.reasoner = reasoner
    backend = GatedBackend()
    m.backend_for = lambda params: backend
    # The compile job is a future the test completes by hand.
    m._executor.submit = lambda fn, params: futures.setdefault(params.regex, Future())
    return m


def constrained(req_id, key, prompt=4, **kw):
    return make_request(req_id, prompt, structured_outputs=StructuredOutputsParams(regex=key), **kw)


def test_waiting_for_grammar_does_not_block_others_then_runs():
    futures = {}
    sched = make_scheduler()
    sched.structured_output_manager = m = manager_with(futures)
    a = constrained("a", "slow", max_tokens=8)
    m.grammar_init(a)
    assert a.status == RequestStatus.WAITING_FOR_FSM
    sched.add_request(a)
    sched.add_request(make_request("b", 4, max_tokens=2))
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["b"] and so.grammar_bitmask is None
    assert a.status == RequestStatus.WAITING_FOR_FSM and sched.waiting.peek_request() is a
    futures["slow"].set_result(ScriptedGrammar([5, 40, 7]))
    so, _ = run_step(sched, token=5)
    assert "a" in so.num_scheduled_tokens and so.structured_output_request_ids == ["a"]
    # The mask of "a" allows token 5 only.
    bits = np.unpackbits(so.grammar_bitmask[0].view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [5]
    so, _ = run_step(sched, token=40)
    assert np.flatnonzero(np.unpackbits(so.grammar_bitmask[0].view(np.uint8), bitorder="little")).tolist() == [40]
    # The script's last token completes the grammar: the request stops there, without an EOS.
    so, outs = run_step(sched, token=7)
    assert np.flatnonzero(np.unpackbits(so.grammar_bitmask[0].view(np.uint8), bitorder="little")).tolist() == [7]
    (out,) = [o for o in outs if o.request_id == "a"]
    assert out.finish_reason is not None and str(out.finish_reason) == "stop" and out.new_token_ids == [7]
    assert a.structured_output_request.grammar.accepted == [5, 40, 7]
    run_step(sched)
    assert_scheduler_empty(sched)


def test_failed_compile_ends_the_request_with_an_output():
    futures = {}
    sched = make_scheduler()
    sched.structured_output_manager = m = manager_with(futures)
    a = constrained("a", "bad")
    m.grammar_init(a)
    sched.add_request(a)
    futures["bad"].set_exception(RuntimeError("boom"))
    so = sched.schedule()
    assert not so.num_scheduled_tokens
    (out,) = sched.take_pending_outputs()
    assert out.request_id == "a" and str(out.finish_reason) == "abort" and "boom" in out.error
    assert_scheduler_empty(sched)


def test_abort_while_waiting_for_grammar():
    futures = {}
    sched = make_scheduler()
    sched.structured_output_manager = m = manager_with(futures)
    a = constrained("a", "slow")
    m.grammar_init(a)
    sched.add_request(a)
    sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    futures["slow"].set_result(ScriptedGrammar([1]))
    sched.schedule()
    assert_scheduler_empty(sched)


def test_constraint_starts_after_the_reasoning():
    futures = {}
    sched = make_scheduler()
    sched.structured_output_manager = m = manager_with(futures, reasoner=ReasonerStub())
    a = constrained("a", "json", max_tokens=10)
    m.grammar_init(a)
    assert not a.structured_output_request.reasoning_ended
    futures["json"].set_result(ScriptedGrammar([5, 6]))
    sched.add_request(a)
    so, _ = run_step(sched, token=11)  # thinking: unconstrained, not fed to the grammar
    assert so.grammar_bitmask is None
    so, _ = run_step(sched, token=99)  # the end tag: not fed either
    assert so.grammar_bitmask is None
    so, _ = run_step(sched, token=5)
    assert so.structured_output_request_ids == ["a"]
    assert a.structured_output_request.grammar.accepted == [5]


def test_reasoning_already_over_in_the_prompt():
    futures = {}
    m = manager_with(futures, reasoner=ReasonerStub())
    a = constrained("a", "j", prompt=[1, 2, 99, 3])
    m.grammar_init(a)
    assert a.structured_output_request.reasoning_ended


def test_mid_prefill_requests_get_no_mask():
    futures = {}
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.structured_output_manager = m = manager_with(futures)
    a = constrained("a", "long", prompt=40)
    m.grammar_init(a)
    futures["long"].set_result(ScriptedGrammar([5]))
    sched.add_request(a)
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 16} and so.grammar_bitmask is None
    assert EOS not in a.output_token_ids
