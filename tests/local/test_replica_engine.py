"""The simulated replica as an engine: slots, a FIFO queue, headers at admission, aborts, metrics
and the faults of real engines (zombie, error after headers, restart)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import pytest

from benchmarks.lab.waiting import eventually_async
from denv_iac.local.replica_model import ReplicaSimConfig
from denv_iac.local.replica_server import ReplicaSim
from denv_iac.local.replica_sim import ReplicaProcess
from tests.dataplane.test_replica_sim import (
    read_chunk,
    read_chunks,
    read_head,
    read_json,
    request,
    run_with_sim,
    send,
)

CHAT = "/v1/chat/completions"
VLLM_RUNNING = 'vllm:num_requests_running{model_name="simulated"}'
VLLM_WAITING = 'vllm:num_requests_waiting{model_name="simulated"}'
VLLM_TOKENS = 'vllm:generation_tokens_total{model_name="simulated"}'

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def metrics(sim: ReplicaSim) -> dict[str, float]:
    reader, writer = await request(sim, "GET", "/metrics")
    status, headers = await read_head(reader)
    text = (await reader.readexactly(int(headers["content-length"]))).decode()
    writer.close()
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_metrics(text)


async def load_is(sim: ReplicaSim, running: int, waiting: int) -> None:
    async def probe() -> bool:
        sample = await metrics(sim)
        return (sample[VLLM_RUNNING], sample[VLLM_WAITING]) == (running, waiting)

    await eventually_async(probe, 3.0, f"{running} running, {waiting} waiting", 0.01)


async def stream(sim: ReplicaSim, **body: object) -> Streams:
    """A streamed chat request whose headers have arrived."""
    reader, writer = await request(sim, "POST", CHAT, {"stream": True, **body})
    status, headers = await read_head(reader)
    assert (status, headers["content-type"]) == (200, "text/event-stream")
    return reader, writer


def events(chunks: list[bytes]) -> list[object]:
    return [json.loads(c[6:]) if c != b"data: [DONE]\n\n" else "[DONE]" for c in chunks]


def contents(chunks: list[bytes]) -> list[str]:
    got = []
    for event in events(chunks):
        if isinstance(event, dict) and "choices" in event:
            got.append(event["choices"][0]["delta"].get("content"))
    return [c for c in got if c is not None]


def test_headers_go_out_at_admission_and_the_first_chunk_when_a_slot_frees() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        busy_reader, busy = await stream(sim, max_tokens=20)  # holds the only slot ~210 ms
        started = time.monotonic()
        reader, writer = await request(sim, "POST", CHAT, {"stream": True, "max_tokens": 2})
        await read_head(reader)
        headers_s = time.monotonic() - started
        await load_is(sim, running=1, waiting=1)
        await read_chunk(reader)
        first_chunk_s = time.monotonic() - started
        assert headers_s < 0.1, headers_s
        assert first_chunk_s >= 0.18, first_chunk_s  # after the busy stream's ~210 ms
        assert len(contents(await read_chunks(busy_reader))) == 20
        busy.close()
        writer.close()

    run_with_sim(scenario, ttft_ms=20, itl_ms=10, slots=1)


def test_the_queue_is_first_in_first_out() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        # Holds the one slot until it hangs up, however slowly the queue below is built.
        _, holder = await stream(sim, max_tokens=10_000)
        order: list[str] = []

        async def first_token(name: str, reader: asyncio.StreamReader) -> None:
            await read_chunk(reader)
            order.append(name)
            await read_chunks(reader)

        waiters = []
        for index, name in enumerate("abcd"):
            reader, writer = await stream(sim, max_tokens=2)
            await load_is(sim, running=1, waiting=index + 1)  # admitted in this order
            waiters.append((asyncio.ensure_future(first_token(name, reader)), writer))
        holder.close()  # aborted: its slot goes to the head of the queue
        await asyncio.gather(*(task for task, _ in waiters))
        assert order == ["a", "b", "c", "d"]
        for _, writer in waiters:
            writer.close()

    run_with_sim(scenario, ttft_ms=5, itl_ms=20, slots=1)


async def token_gaps(reader: asyncio.StreamReader) -> list[float]:
    times = []
    while chunk := await read_chunk(reader):
        if b'"content"' in chunk:
            times.append(time.monotonic())
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def test_time_between_tokens_grows_with_the_batch() -> None:
    # itl(n) = itl_ms * (1 + itl_growth * (n - 1)): 20 ms alone, 80 ms with 4 decoding.
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await stream(sim, max_tokens=6)
        alone = await token_gaps(reader)
        writer.close()
        batch = [await stream(sim, max_tokens=6) for _ in range(4)]
        batched = await asyncio.gather(*(token_gaps(reader) for reader, _ in batch))
        for _, writer in batch:
            writer.close()
        mean_alone = sum(alone) / len(alone)
        mean_batched = sum(g for gaps in batched for g in gaps) / sum(map(len, batched))
        assert 0.015 <= mean_alone < 0.035, mean_alone
        assert 0.065 <= mean_batched < 0.1, mean_batched

    run_with_sim(scenario, ttft_ms=0, itl_ms=20, itl_growth=1.0, slots=8)


@pytest.mark.parametrize("who_leaves", ["running", "waiting"])
def test_a_client_that_disconnects_is_aborted_and_frees_its_place(who_leaves: str) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        _, running = await stream(sim, max_tokens=1000)  # 10 s of tokens
        waiting_reader, waiting = await stream(sim, max_tokens=2)
        await load_is(sim, running=1, waiting=1)
        if who_leaves == "running":
            running.close()
            await load_is(sim, running=1, waiting=0)  # the waiting one took the slot
            assert len(contents(await read_chunks(waiting_reader))) == 2
            await load_is(sim, running=0, waiting=0)
            waiting.close()
        else:
            waiting.close()
            await load_is(sim, running=1, waiting=0)
            running.close()
            await load_is(sim, running=0, waiting=0)
        assert sim.stats.requests_aborted == (1 if who_leaves == "running" else 2)

    run_with_sim(scenario, ttft_ms=0, itl_ms=10, slots=1)


@pytest.mark.parametrize("queue_limit", [0, 2])
def test_past_the_queue_limit_a_request_gets_openai_503_before_any_byte(queue_limit: int) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        held = [await stream(sim, max_tokens=1000)]
        held += [await stream(sim, max_tokens=1) for _ in range(queue_limit)]
        await load_is(sim, running=1, waiting=queue_limit)
        reader, writer = await request(sim, "POST", CHAT, {"stream": True, "max_tokens": 1})
        status, headers, body = await read_json(reader)
        assert status == 503 and headers["content-type"] == "application/json"
        assert body == {
            "error": {
                "message": f"the server is full: {queue_limit} requests are waiting for 1 slots;"
                " retry later",
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
        }
        await load_is(sim, running=1, waiting=queue_limit)  # the refused one took no place
        for _, held_writer in held:
            held_writer.close()
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=10, slots=1, queue_limit=queue_limit)


@pytest.mark.parametrize(
    ("engine", "running", "waiting", "counted"),
    [
        ("vllm", VLLM_RUNNING, VLLM_WAITING, VLLM_TOKENS),
        (
            "sglang",
            'sglang:num_running_reqs{model_name="simulated"}',
            'sglang:num_queue_reqs{model_name="simulated"}',
            'sglang:generation_tokens_total{model_name="simulated"}',
        ),
        ("tgi", "tgi_batch_current_size", "tgi_queue_size", "tgi_request_count"),
    ],
)
def test_metrics_use_the_engines_own_names(
    engine: str, running: str, waiting: str, counted: str
) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        done_reader, done = await stream(sim, max_tokens=3)
        await read_chunks(done_reader)
        before = await metrics(sim)
        held = [await stream(sim, max_tokens=1000) for _ in range(3)]

        async def probe() -> bool:
            sample = await metrics(sim)
            return (sample[running], sample[waiting]) == (2, 1)

        await eventually_async(probe, 3.0, "2 running, 1 waiting", 0.01)
        after = await metrics(sim)
        # vLLM and SGLang count generated tokens; TGI counts requests.
        assert before[counted] == (3 if engine != "tgi" else 1)
        assert after[counted] >= before[counted] + (0 if engine != "tgi" else 3)
        if engine != "tgi":
            prefix = engine + ":"
            assert after[f'{prefix}prompt_tokens_total{{model_name="simulated"}}'] == 0
            usage = "kv_cache_usage_perc" if engine == "vllm" else "token_usage"
            assert after[f'{prefix}{usage}{{model_name="simulated"}}'] == 1.0
        prefix = {"vllm": "vllm:", "sglang": "sglang:", "tgi": "tgi_"}[engine]
        assert all(name.startswith(prefix) for name in after), sorted(after)
        for _, writer in held:
            writer.close()
        done.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=10, slots=2, engine=engine)


def test_prompt_tokens_are_counted_when_decoding_begins() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        messages = [{"role": "user", "content": "one two three"}, {"content": "four"}]
        reader, writer = await stream(sim, max_tokens=1, messages=messages)
        await read_chunks(reader)
        assert (await metrics(sim))['vllm:prompt_tokens_total{model_name="simulated"}'] == 4
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=0)


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"max_completion_tokens": 3}, 3),
        ({"max_tokens": 4}, 4),
        ({"max_tokens": 5, "max_completion_tokens": 2}, 2),  # as vLLM: the newer field wins
        ({}, 6),
    ],
)
def test_max_completion_tokens_is_read_as_max_tokens(body: dict[str, int], tokens: int) -> None:
    async def scenario(sim: ReplicaSim) -> None:
        reader, writer = await stream(sim, **body)
        assert len(contents(await read_chunks(reader))) == tokens
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=0, tokens=6)


async def set_fault(sim: ReplicaSim, mode: str, k: int = 0) -> None:
    reader, writer = await request(sim, "POST", "/control/fault", {"mode": mode, "k": k})
    assert (await read_json(reader))[2] == {"fault": mode, "k": k}
    writer.close()


async def health(sim: ReplicaSim) -> int:
    reader, writer = await request(sim, "GET", "/health")
    status = (await read_json(reader))[0]
    writer.close()
    return status


def test_zombie_answers_health_and_headers_but_makes_no_token_until_cleared() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        await set_fault(sim, "zombie")
        assert await health(sim) == 200
        reader, writer = await stream(sim, max_tokens=3)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_chunk(reader), 0.3)
        sample = await metrics(sim)
        assert (sample[VLLM_RUNNING], sample[VLLM_TOKENS]) == (1, 0)
        await set_fault(sim, "none")
        assert len(contents(await read_chunks(reader))) == 3
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=5)


def test_error_after_headers_ends_the_stream_with_an_error_event_after_k_tokens() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        await set_fault(sim, "error_after_headers", 2)
        reader, writer = await stream(sim, max_tokens=6)
        chunks = await read_chunks(reader)  # ends with the terminal chunk: a clean end
        assert contents(chunks) == ["tok0 ", "tok1 "]
        error, done = events(chunks)[-2:]
        assert done == "[DONE]"
        assert error == {
            "error": {
                "message": "the engine failed the request",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        await send(writer, "POST", CHAT, {"max_tokens": 6})
        status, _, body = await read_json(reader)
        assert status == 500 and body["error"]["code"] == 500  # type: ignore[index]
        assert sim.stats.streams_failed == 2 and sim.stats.streams_completed == 0
        await load_is(sim, running=0, waiting=0)
        writer.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=5)


def test_engine_restart_ends_running_and_queued_requests_then_serves_again() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        running_reader, running = await stream(sim, max_tokens=1000)
        assert b"tok0" in await read_chunk(running_reader)
        queued_reader, queued = await stream(sim, max_tokens=2)
        await load_is(sim, running=1, waiting=1)
        await set_fault(sim, "engine_restart", 400)
        made = (await metrics(sim))[VLLM_TOKENS]
        for reader, at_most in ((running_reader, made), (queued_reader, 0)):
            chunks = await read_chunks(reader)
            assert len(contents(chunks)) <= at_most  # tokens made before the restart, no more
            assert events(chunks)[-2] == {
                "error": {
                    "message": "the engine restarted",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        await load_is(sim, running=0, waiting=0)
        # While it restarts, health and requests are answered 503.
        assert await health(sim) == 503
        reader, writer = await request(sim, "POST", CHAT, {"stream": True, "max_tokens": 1})
        assert (await read_json(reader))[0] == 503
        writer.close()

        async def healthy() -> bool:
            return await health(sim) == 200

        await eventually_async(healthy, 3.0, "healthy again after the restart", 0.01)
        reader, writer = await stream(sim, max_tokens=2)
        assert len(contents(await read_chunks(reader))) == 2
        writer.close()
        running.close()
        queued.close()

    run_with_sim(scenario, ttft_ms=0, itl_ms=10, slots=1)


SPEECH = {"model": "tts", "input": "hello", "response_format": "pcm"}


def test_speech_has_its_own_slots_and_queue() -> None:
    async def scenario(sim: ReplicaSim) -> None:
        # Chat is idle with its own slots; speech has one slot: the second synthesis waits.
        first_reader, first = await request(sim, "POST", "/v1/audio/speech", SPEECH)
        await read_head(first_reader)
        started = time.monotonic()
        reader, writer = await request(sim, "POST", "/v1/audio/speech", SPEECH)
        status, headers = await read_head(reader)
        headers_s = time.monotonic() - started
        assert (status, headers["content-type"]) == (200, "audio/pcm")
        await load_is(sim, running=1, waiting=1)
        chat_reader, chat = await stream(sim, max_tokens=1)  # not behind the speech queue
        assert len(contents(await read_chunks(chat_reader))) == 1
        frames = await read_chunks(reader)
        assert len(frames) == 8 and headers_s < 0.1
        assert time.monotonic() - started >= 0.15  # 8 frames of the first, then 8 of its own
        await read_chunks(first_reader)
        for w in (first, writer, chat):
            w.close()

    run_with_sim(scenario, ttft_ms=10, itl_ms=10, tokens=8, speech_slots=1)


def test_transcription_has_its_own_slots_and_queue() -> None:
    boundary = "b0undary"
    upload = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\nRIFF\r\n--{boundary}--\r\n"
    ).encode()

    async def transcribe() -> float:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", sim_port[0])
        writer.write(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: sim\r\n"
            + f"Content-Type: multipart/form-data; boundary={boundary}\r\n".encode()
            + f"Content-Length: {len(upload)}\r\n\r\n".encode()
            + upload
        )
        status, _, _ = await read_json(reader)
        writer.close()
        assert status == 200
        return time.monotonic() - started

    sim_port: list[int] = []

    async def scenario(sim: ReplicaSim) -> None:
        sim_port.append(sim.port)
        times = sorted(await asyncio.gather(transcribe(), transcribe(), transcribe()))
        # One slot, 100 ms each: answered one after the other.
        assert times[0] < 0.18 and times[1] >= 0.19 and times[2] >= 0.29, times

    run_with_sim(scenario, ttft_ms=100, itl_ms=0, transcription_slots=1)


def test_the_process_takes_its_capacity_and_engine_from_the_command_line() -> None:
    config = ReplicaSimConfig(
        "voice.local.n1.0", ttft_ms=0, itl_ms=10, engine="tgi", slots=1, queue_limit=0
    )
    process = ReplicaProcess(config)
    process.spawn()
    try:
        url = f"http://127.0.0.1:{process.wait_ready()}"
        body = {"stream": True, "max_tokens": 1000}
        with httpx.Client() as client, client.stream("POST", f"{url}{CHAT}", json=body) as held:
            assert held.status_code == 200
            refused = client.post(f"{url}{CHAT}", json=body)
            assert refused.status_code == 503
            sample = parse_metrics(client.get(f"{url}/metrics").text)
            assert (sample["tgi_batch_current_size"], sample["tgi_queue_size"]) == (1, 0)
    finally:
        process.stop()
