"""An SGLang server's membership of the trainer's weight-sync group, driven over its
HTTP API: ``/init_weights_update_group`` (its tensor-parallel workers join as ranks
``rank_offset`` onwards), one ``/update_weights_from_distributed`` per bucket of the
sync's manifest (``load_format="flattened_bucket"``: the bucket is one broadcast of its
tensors flattened in order, which the trainer sends from group rank 0 meanwhile), and
``/destroy_weights_update_group``. The membership is the server's, not the process's
that drives it, so no other role can take it over.

The two calls that enter a collective are made once, never retried (a second attempt
would wait for peers that are not coming). Before it joins, the server destroys any
group it still holds under the sync's name (one abandoned when a member died), since
SGLang refuses a second group under a name in use. A bucket the server fails to load
(its model does not fit the trainer's, say) it has still received, as SGLang receives a
bucket before loading it: the remaining buckets are posted all the same, so the
trainer's broadcast of them finishes, and the sync fails after the last."""

from dynarl.workers.errors import WeightSyncError
from dynarl.workers.sglang import messages as m
from dynarl.workers.sglang.client import SGLangClient
from dynarl.workers.sglang.errors import ServerError
from dynarl.workers.weights import GROUP_NAME, WeightManifest, WeightSyncGroup


class ServerGroup:
    """The weight-sync group membership of the server behind ``client``.

    Args:
        client: the server's client.
        name: for error messages.
        tp_size: the server's tensor-parallel workers (ranks it takes).
        backend: the group's collective backend (``nccl`` on GPUs).
    """

    def __init__(self, client: SGLangClient, *, name: str, tp_size: int, backend: str) -> None:
        self.client = client
        self.name = name
        self.tp_size = tp_size
        self.backend = backend
        self.joined = False

    async def join(self, group: WeightSyncGroup) -> None:
        """Have the server join ``group`` (returns once every member joined).

        Raises:
            WeightSyncError: the group gives it another number of ranks than its
                tensor-parallel workers, or the server could not join.
        """
        if group.num_ranks != self.tp_size:
            raise WeightSyncError(
                f"{self.name}: the weight-sync group gives the server {group.num_ranks} "
                f"ranks, but it runs tp_size={self.tp_size}; set rollout.tp to the "
                f"servers' --tp-size"
            )
        # A group the server still holds keeps the sync's name taken, and SGLang refuses
        # a second group under a name in use (torch's _new_process_group_helper). The
        # controller abandons a group without leaving it when a member dies (leaving is
        # collective), and a server outlives the process that drives it: destroy
        # whatever it holds first.
        await self._destroy()
        reply = await self.client.post_as(
            "/init_weights_update_group",
            m.InitWeightsUpdateGroupReqInput(
                master_address=group.host,
                master_port=group.port,
                rank_offset=group.rank,
                world_size=group.world_size,
                group_name=GROUP_NAME,
                backend=self.backend,
            ),
            m.SuccessResponse,
            retry=False,
        )
        if not reply.success:
            raise WeightSyncError(f"{self.name}: the server could not join: {reply.message}")
        self.joined = True

    async def receive(self, manifest: WeightManifest) -> int:
        """Have the server receive the broadcast ``manifest`` describes, bucket by
        bucket, the last call flushing its cache and taking the version; returns it.

        Raises:
            WeightSyncError: a bucket failed (after every bucket was posted, unless the
                server stopped answering), or the server is in no group.
        """
        if not self.joined:
            raise WeightSyncError(f"{self.name} is in no weight-sync group; join one first")
        failed: str | None = None
        for i, bucket in enumerate(manifest.buckets):
            last = i == len(manifest.buckets) - 1
            request = m.UpdateWeightsFromDistributedReqInput(
                names=list(bucket.names),
                dtypes=list(bucket.dtypes),
                shapes=[list(s) for s in bucket.shapes],
                group_name=GROUP_NAME,
                flush_cache=last,
                weight_version=str(manifest.version) if last and failed is None else None,
                load_format="flattened_bucket",
            )
            try:
                reply = await self.client.post_as(
                    "/update_weights_from_distributed", request, m.SuccessResponse, retry=False
                )
            except ServerError as e:
                if not e.status:  # no answer: it is not receiving the rest either
                    raise WeightSyncError(f"{self.name}: weight update failed: {e}") from e
                reply = m.SuccessResponse(success=False, message=str(e))
            if not reply.success and failed is None:
                failed = f"bucket {i} of {len(manifest.buckets)}: {reply.message}"
        if failed is not None:
            raise WeightSyncError(f"{self.name}: weight update failed at {failed}")
        return manifest.version

    async def leave(self) -> None:
        """Have the server leave the group; a no-op when it is in none."""
        if self.joined:
            self.joined = False
            await self._destroy()

    async def _destroy(self) -> None:
        """Have the server destroy the group it holds under the sync's name, if any
        (SGLang answers 400 when it holds none)."""
        try:
            await self.client.post(
                "/destroy_weights_update_group",
                m.DestroyWeightsUpdateGroupReqInput(group_name=GROUP_NAME),
            )
        except ServerError as e:
            if e.status != 400:
                raise
