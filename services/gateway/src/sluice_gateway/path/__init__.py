"""The one inference path at the centre: every front and the job worker call it; it imports none of them.

core builds it (tenants, model catalog, admission, completion events, default deadlines) and
inference_path runs a Generate or Embed call through it.
"""
