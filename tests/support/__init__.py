"""Helpers the tests share: live servers and the scripted model, SSE readers, agent CLIs, reference forwards."""
