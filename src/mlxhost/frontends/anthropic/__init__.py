"""Anthropic's Messages API: protocol (request bodies), translate (to the one internal request), render
(the message and its SSE events), errors (Anthropic's error shape), routes."""
