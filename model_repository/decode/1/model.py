"""decode (decoupled): sealed prompt ids + prefill's KV and first token -> streamed answer.

Without KV it prefills locally, in chunks between decode steps; a KV handle it cannot
pull (expired, prefill gone) is recomputed from the ids, never re-rendered; the KV of a
request that ends before decode pulled it (cancelled, failed or expired in the queue) is
discarded at once (KVHandover), not left to its TTL. All running
requests advance in one forward pass per step (continuous batching,
`pdchat.core.generation.scheduler`); execute() only validates and queues. Every call into the server (responses, errors,
cancel acknowledgements, cancellation checks, metrics) runs on the outbox thread
(pdchat.triton.outbox), in order, while the scheduler thread runs the next forward pass.
A request carrying only `cancel_request_id` (sealed by chat) stops the named request instead.
With `first_output_sent` (and a KV handle), its client has the stream's first output from
prefill already (TextModel.first_output): decode makes it too, and does not send it.
"""

import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from pdchat import tensors
from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.engine import DecodeBatch
from pdchat.core.generation.generation import TextModel
from pdchat.core.generation.pass_threads import PassThreads
from pdchat.core.generation.sampling import Choice
from pdchat.core.generation.scheduler import DecodeJob, DecodeScheduler, Limits
from pdchat.core.kv.connector import Connectors, KVHandover, KVUnavailable
from pdchat.core.output.decode_streams import DecodeStream, DecodeStreams
from pdchat.core.output.feeds import DecodeFeeds
from pdchat.core.settings import batching_options, keep_off_decode_cpus, kv_options, prefill_threads_when_idle
from pdchat.ensemble.decode_load import LoadSlot
from pdchat.ensemble.seal import StageSeal, server_directory
from pdchat.models import resolve_model
from pdchat.triton import io
from pdchat.triton.kv_events import KVEvents
from pdchat.triton.metrics import DecodeMetrics, KVPoolMetrics, StreamMetrics, VllmMetrics
from pdchat.triton.outbox import Outbox
from pdchat.triton.server_watch import exit_with_server

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("pdchat.decode")
KV_PULL_THREADS = 2  # KV pulls that wait on the network (NIXL) at once, off the scheduler thread


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()  # a stub outliving its server frees its memory and exits
        parameters = io.model_parameters(args)
        cpus = keep_off_decode_cpus(parameters)  # the scheduler thread takes cpus.decode
        kind, device_id = io.instance_placement(args)
        if kind == "GPU" and device_id > 0:
            log.warning(
                "decode runs an instance per GPU here; chat's cancellations reach the instance they land on, "
                "not always the request's: run a server per GPU (CUDA_VISIBLE_DEVICES)"
            )
        settings = resolve_model(parameters).on_instance(kind, device_id)
        self.model = TextModel.for_stage("decode", settings, parameters)
        self.seal = StageSeal.for_this_server()
        self.connectors = Connectors(**kv_options(parameters))
        self.kv_events = KVEvents("decode", parameters, args, self.model.engine.pool)  # off unless its endpoint is set
        self.metrics = DecodeMetrics(args["model_name"])
        self.pool_metrics = KVPoolMetrics(args["model_name"], args["model_instance_name"])
        self.vllm_metrics = VllmMetrics(settings.served_name, args["model_instance_name"])  # vLLM's names
        self.options = batching_options(parameters)
        limits = Limits(
            max_running=self.options.max_running,
            kv_blocks=self.model.engine.pool.total_blocks,
            block_tokens=self.model.engine.pool.block_tokens,
            max_wait_s=self.options.queue_timeout_s,
        )
        # About one step's responses may wait for the outbox before the scheduler waits too.
        self.outbox = Outbox("pdchat-decode-outbox", max_pending=2 * self.options.max_running)
        self.pulls = ThreadPoolExecutor(KV_PULL_THREADS, thread_name_prefix="pdchat-kv-pull")
        self.feeds = DecodeFeeds(io.StreamTransport(), on_closed=self.outbox.unwatch)  # on the outbox thread
        # What chat reads to let an idle decode prefill a prompt itself (setting local_prefill_when_idle).
        self.load = LoadSlot(
            server_directory(os.getppid()), args["model_instance_name"], limits.kv_blocks * limits.block_tokens
        )
        # chat gives decode a prompt to prefill only while the server is idle (local_prefill_when_idle),
        # so its chunks take every core while no row runs (none when decode_cpus binds the scheduler).
        lone_prompt_threads = None
        if cpus is None:
            most = prefill_threads_when_idle(parameters)
            lone_prompt_threads = PassThreads.for_engine(self.model.engine, most, watch_cores=False)
        self.scheduler = DecodeScheduler(
            DecodeBatch(self.model.engine),
            limits,
            on_state=self._on_state,
            on_load=self.load.set,
            on_emitted=functools.partial(self.outbox.call, self.feeds.flush),
            cpus=cpus and cpus.decode,
            pass_threads=lone_prompt_threads,
        )
        self.streams = DecodeStreams(
            io.StreamTransport(),
            StreamMetrics(self.metrics, self.vllm_metrics),
            self.feeds,
            cancel=self.scheduler.cancel,
            unwatch=self.outbox.unwatch,
        )
        if cpus is not None:
            log.info("%s: %s (setting decode_cpus)", args["model_instance_name"], cpus.describe())

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                feed = io.feed_opened(request)
                if feed is not None:
                    self.seal.check_feed(feed, io.input_text(request, tensors.STAGE_SEAL))
                    self.outbox.call(functools.partial(self._open_feed, feed, sender))
                    continue
                cancel = io.input_text(request, tensors.CANCEL_REQUEST_ID)
                if cancel is not None:
                    self.seal.check_cancel(cancel, io.input_text(request, tensors.STAGE_SEAL))
                    self.scheduler.cancel(cancel)
                    self.outbox.call(functools.partial(sender.send, flags=FINAL))
                    continue
                job, stream, grammar = self._job(request, sender)
            except Exception as exc:  # noqa: BLE001
                self.outbox.call(functools.partial(sender.send, io.error_response(exc), flags=FINAL))
                continue
            # NOTE: a job is queued once its grammar is compiled: no compile on the scheduler thread.
            self.model.constraints.prepare(grammar).add_done_callback(functools.partial(self._queue, job, stream))
        return None

    def finalize(self):
        self.pulls.shutdown(wait=False, cancel_futures=True)
        self.scheduler.close()
        self.load.close()
        self.kv_events.close()
        self.model.close()
        self.outbox.call(self.feeds.close_all)
        self.outbox.close()
        self.connectors.close()
        self.metrics.close()
        self.pool_metrics.close()
        self.vllm_metrics.close()

    def _queue(self, job: DecodeJob, stream: DecodeStream, compiled: Future) -> None:
        """Queue `job` for the scheduler, or fail it with its grammar's error. NOTE: a KV pull
        that waits on the network (NIXL) runs first, on a pull thread, never on the
        scheduler's: the batch's rows keep stepping meanwhile."""
        error = compiled.exception()
        if error is not None:
            job.fail(error)
        elif stream.kv is not None and stream.kv.pull_waits:
            self.pulls.submit(stream.kv.prefetch).add_done_callback(functools.partial(self._submit, job, stream))
        else:
            self._submit(job, stream)

    def _submit(self, job: DecodeJob, stream: DecodeStream, _pulled: Future | None = None) -> None:
        self.scheduler.submit(job)
        if stream.left:  # its caller left while its grammar compiled or its KV came
            self.scheduler.cancel(job.key)

    def _job(self, request, sender) -> tuple[DecodeJob, DecodeStream, dict | None]:
        """The request's job and stream, and the output grammar its start needs compiled."""
        engine = self.model.engine
        stage = io.stage_input(request, self.seal, engine.context_length, engine.vocab_size)
        # Prefill's KV and first token come only inside a sealed handle; without one decode prefills.
        kv = None if stage.kv_handle is None else KVHandover(self.connectors, stage.kv_handle)
        try:
            return self._sealed_job(request, sender, stage, kv)
        except BaseException:
            if kv is not None:
                kv.end()  # refused here: its KV is freed now
            raise

    def _sealed_job(self, request, sender, stage, kv: KVHandover | None) -> tuple[DecodeJob, DecodeStream, dict | None]:
        engine = self.model.engine
        ids, params, handle = stage.prompt_token_ids, stage.params, stage.kv_handle
        first = None if handle is None else Choice(handle.first_token_id, handle.first_token_logprobs)
        if first is not None and not 0 <= first.token_id < engine.vocab_size:
            raise InvalidRequest(f"the KV handle's first token {first.token_id} is not in this model's vocabulary")
        # The client has prefill's first output already: decode's first delta is not sent again.
        first_sent = first is not None and bool(io.input_scalar(request, tensors.FIRST_OUTPUT_SENT))
        feed, feed_key = io.feed_named(request)
        stream = DecodeStream(
            params.request_id,
            sender,
            self.model.assembler(ids, params, first_output_sent=first_sent),
            io.requested_client_outputs(request),
            io.heartbeat_s(request),
            given_first=first is not None,
            kv=kv,
            feed=feed,
            feed_key=feed_key,
        )
        self.outbox.call(functools.partial(self.vllm_metrics.arrived, stream.key, time.monotonic()))

        def start():  # on the scheduler thread, on admission
            self.outbox.call(functools.partial(self.streams.started, stream))
            kv_source = None if kv is None else functools.partial(self._pull, kv, params.request_id)
            released = None if kv is None else kv.done
            return self.model.generation(
                ids,
                params,
                first=first,
                kv_source=kv_source,
                on_kv_released=released,
                prefill_chunk=self.options.prefill_chunk,
                cached_tokens=0 if handle is None else handle.cached_tokens,
            )

        self.outbox.watch(stream, sender.is_cancelled, functools.partial(self._client_left, stream))
        job = DecodeJob(
            key=stream.key,
            start=start,
            emit=functools.partial(self._on_outbox, self.streams.send, stream),
            fail=functools.partial(self._on_outbox, self.streams.close, stream, "failed"),
            on_cancel=functools.partial(self._on_outbox, self.streams.close, stream, "cancelled"),
            tokens=len(ids) + params.max_tokens,
        )
        return job, stream, params.constraint

    def _on_outbox(self, function, *args) -> None:
        """From the scheduler thread: `function(*args)` on the outbox thread, in order."""
        self.outbox.call(functools.partial(function, *args))

    def _on_state(self, state) -> None:
        self.outbox.call(functools.partial(self.metrics.scheduler, state.waiting, state.kv_bytes))
        usage = self.model.engine.pool.usage()
        self.outbox.call(functools.partial(self.pool_metrics.update, usage))
        self.outbox.call(functools.partial(self.vllm_metrics.pool, usage))
        self.outbox.call(functools.partial(self.vllm_metrics.requests, state.running, state.waiting))

    # On the outbox thread:

    def _client_left(self, stream: DecodeStream) -> None:
        stream.left = True
        self.scheduler.cancel(stream.key)

    def _open_feed(self, feed: str, sender) -> None:
        if self.feeds.open(feed, sender):
            self.outbox.watch(feed, sender.is_cancelled, functools.partial(self.feeds.close, feed))

    def _pull(self, handover: KVHandover, request_id, start_token):
        """The KV a handle names, of its tokens from `start_token` on (those before are in
        decode's prefix cache), or None (decode then recomputes it from the ids)."""
        try:
            kv = handover.pull(start_token)
        except KVUnavailable as exc:
            log.warning("request %s: KV pull failed, recomputing prefill from the forwarded ids: %s", request_id, exc)
            self.outbox.call(functools.partial(self.metrics.kv_pull, "recomputed"))
            return None
        self.outbox.call(functools.partial(self.metrics.kv_pull, "pulled"))
        return kv
