"""Bulk jobs: the job RPCs' logic (api), the rules of a job and its rows (job), their store, and the
job worker (`python -m sluice_gateway.jobs.worker`) that runs rows through the inference path.
"""
