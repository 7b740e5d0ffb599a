"""The voice-to-voice benchmark's accounting, on hand-made turns: first audio counts from the
end of the user's speech, audio heard is 24 kHz PCM16, the share of the answer spoken counts the
words sent to the TTS, and a request sent twice in one turn is a repeat."""

import math

import pytest

from benchmarks.voice_to_voice import Turn, stage_ms, summarize_faults, turn_figures

STT, CHAT, SPEECH = "/v1/audio/transcriptions", "/v1/chat/completions", "/v1/audio/speech"
WHOLE = "tok0 tok1 tok2 tok3"
ONE_SECOND = 48_000  # bytes of 24 kHz PCM16


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        # A whole turn: first audio 0.4 s after the end of speech, 1.5 s of it, all the answer.
        (
            Turn(10.0, [(10.4, ONE_SECOND), (10.5, ONE_SECOND // 2)], [STT, CHAT, SPEECH], [WHOLE]),
            {"first_audio_ms": 400.0, "heard_s": 1.5, "spoken_fraction": 1.0, "repeated": 0.0},
        ),
        # The answer cut after its first word: that word spoken, and the error reported.
        (
            Turn(10.0, [(10.2, ONE_SECOND)], [STT, CHAT, SPEECH], ["tok0"], ["stream cut"]),
            {"first_audio_ms": 200.0, "spoken_fraction": 0.25, "errors": 1.0},
        ),
        # Nothing heard: no first audio at all, not a zero.
        (
            Turn(10.0, [], [STT, CHAT], [], ["connection refused"]),
            {"first_audio_ms": None, "heard_s": 0.0, "spoken_fraction": 0.0, "errors": 1.0},
        ),
        # An answer of two sentences: a speech request each, nothing repeated.
        (
            Turn(
                10.0, [(10.3, ONE_SECOND)], [STT, CHAT, SPEECH, SPEECH], ["tok0 tok1", "tok2 tok3"]
            ),
            {"repeated": 0.0, "spoken_fraction": 1.0},
        ),
        # The TTS retried after partial audio: the speech request twice, the answer spoken twice.
        (
            Turn(10.0, [(10.3, ONE_SECOND)], [STT, CHAT, SPEECH, SPEECH], [WHOLE, WHOLE]),
            {"repeated": 1.0, "spoken_fraction": 2.0, "errors": 0.0},
        ),
    ],
)
def test_turn_figures(turn: Turn, expected: dict[str, float | None]) -> None:
    figures = turn_figures(turn, answer_words=len(WHOLE.split()))
    for key, value in expected.items():
        assert figures[key] == (None if value is None else pytest.approx(value)), key


def _figures(first: float | None, heard: float, repeated: float = 0.0) -> dict[str, float | None]:
    return {
        "first_audio_ms": first,
        "heard_s": heard,
        "spoken_fraction": heard / 2,
        "repeated": repeated,
        "errors": 1.0 if first is None else 0.0,
    }


def test_fault_summary_takes_the_worst_and_counts_silent_turns() -> None:
    faulted = [_figures(300.0, 2.0), _figures(500.0, 1.0, repeated=1.0), _figures(None, 0.0)]
    summary = summarize_faults("x", faulted, [_figures(450.0, 2.0), _figures(470.0, 2.0)])
    assert math.isnan(summary["x_first_audio_max_ms"])  # a silent turn has no first audio
    assert summary["x_silent_turns"] == 1.0
    assert summary["x_heard_min_s"] == 0.0 and summary["x_spoken_fraction_min"] == 0.0
    assert summary["x_repeated"] == 1.0 and summary["x_errors"] == 1.0
    assert summary["x_next_turn_first_audio_max_ms"] == 470.0
    audible = summarize_faults("x", faulted[:2], [])
    assert audible["x_first_audio_max_ms"] == 500.0 and audible["x_silent_turns"] == 0.0
    assert math.isnan(audible["x_next_turn_first_audio_max_ms"])


def test_stages_split_the_turn_from_the_end_of_speech_to_the_first_audio() -> None:
    turn = Turn(
        10.0,
        audio=[(10.5, ONE_SECOND)],
        requests=[STT, CHAT, SPEECH, SPEECH],
        sent_at=[10.01, 10.12, 10.4, 10.9],
    )
    stages = stage_ms(turn)
    assert stages == {
        "pipeline": pytest.approx(10.0),
        "stt": pytest.approx(110.0),
        "llm": pytest.approx(280.0),
        "tts": pytest.approx(100.0),  # from the first speech request, not the repeat
    }
    assert sum(stages.values()) == pytest.approx(500.0)  # the turn's first audio
    # A turn that never reached the LLM: the stages it had, and no more.
    cut = Turn(10.0, requests=[STT], sent_at=[10.01])
    assert stage_ms(cut) == {"pipeline": pytest.approx(10.0)}
