"""OpenAI's Responses API: protocol (request bodies), tools (function and namespace tools, hosted ones
skipped), translate (to the one internal request), render (the response object and its events), store
(stored responses for previous_response_id), routes."""
