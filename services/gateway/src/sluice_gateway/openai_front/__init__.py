"""The OpenAI-compatible HTTP front: chat, completions, embeddings, models, and the Files and Batch APIs.

Over the inference path (and the JobsPort for batches); the mapping to and from OpenAI's shapes is
plain code (requests, choices, batches), the aiohttp routes are http and batch_http.
"""
