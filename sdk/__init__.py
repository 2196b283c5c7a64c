"""The OpenTinker client SDK: submit jobs, follow their metrics, write environments.

    client.py        Client / SyncClient: submit train, SFT and inference jobs, follow
                     their events and metrics, read records and history (NATS, or REST
                     as a user with an API key)
    infer.py         run a base model, an adapter or a job's policy on an environment
    wandb_bridge.py  a job's metrics and rollout figures to a wandb run

The environment API (AbstractGame, StepResult) lives in
`opentinker.environment.base_game` (OpenTinker's own import path), the one module that
users' environments and the envhost service both import; it is re-exported here.
Imports schemas, the bus and the config only: never torch, vLLM or a server extra.
"""

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.sdk.client import (
    AuthenticationError, Client, InferenceEndpoint, Job, JobFailed, SyncClient, SyncJob,
)

__all__ = ["AbstractGame", "AuthenticationError", "Client", "InferenceEndpoint", "Job", "JobFailed", "StepResult",
           "SyncClient", "SyncJob"]
