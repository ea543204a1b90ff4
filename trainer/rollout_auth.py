"""Credentials on the trainer's requests to a rollout replica that needs them.

A private rollout Space answers only requests that carry ``Authorization: Bearer <HF token>``; a
replica started with ``ROLLOUT_API_KEY`` answers only ``Bearer <that key>``. The trainer's own
requests (health polls, the evaluation) take ``TrainConfig.rollout_headers`` directly. TRL's rollout
child posts to ``/v1/completions`` from an aiohttp session that takes no headers, so
:class:`AuthRolloutLoop` (installed by ``trl_compat.authorize_rollouts``) adds the header read
from ``$DELTASYNC_ROLLOUT_AUTHORIZATION``, which the trainer sets before the child is spawned.
The value is never logged.
"""

from __future__ import annotations

import os

import aiohttp
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

AUTH_VAR = "DELTASYNC_ROLLOUT_AUTHORIZATION"


class AuthRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, with ``$DELTASYNC_ROLLOUT_AUTHORIZATION`` sent on every POST.

    ``_post`` is TRL 1.16.0's own (``async_rollout_worker.py``) plus the ``headers`` argument.
    """

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        value = os.environ.get(AUTH_VAR)
        headers = {"Authorization": value} if value else None

        async def _do_post():
            async with self.session.post(
                f"{self.vllm_server_url}{path}",
                json=payload,
                timeout=client_timeout,
                headers=headers,
            ) as response:
                response.raise_for_status()
                content = await response.json()
                return content if content else {}

        return await self._retry(_do_post, label=f"POST {path}", max_attempts=max_retries)
