"""The protocols the simulated replica and the load generator share, one rule each: the audio
they send (PCM16 frames, the WAV header), a transcription's multipart form, and the realtime
WebSocket (its handshake on both sides, and the framing over asyncio streams).

Both ends take each rule from here, so the load generator measures against the very bytes the
simulator speaks. No I/O beyond the streams a caller passes in (tests/test_layers.py).
"""
