"""The generation backend of a sampling trainer, from its choice to its close: which backend samples
(``_choose_backend``), asynchronous generation over it (``_generate_asynchronously``, ``_generate_ahead``:
trainers/sampling/async_rounds.py), and its lifetime (closed when train() ends, a run stopped by a failed server or
producer with a checkpoint). A mixin of SamplingTrainer (sampling/trainer.py), as sampling/prompts.py is."""

from __future__ import annotations

from trainers.errors import GenerationError, RemoteServiceError, VLLMServerError
from trainers.generation.backend import Backend, BackendInputs, PolicyBackend, build_backend
from trainers.generation.sampling import GenerationContext
from trainers.generation.user_rollout import RolloutFuncBackend
from trainers.generation.vllm_common import VLLMBackend
from trainers.logs import logger
from trainers.sampling.async_rounds import AsyncRounds, ReadAhead, Work


class GenerationLifetime:
    """The generation backend's choice and lifetime (module docstring)."""

    def _choose_backend(self) -> Backend:
        """The one place the generation backend is chosen (trainers/generation/backend.py): generation_backend
        when given, else a user's rollout_func (over vLLM with use_vllm, as TRL's), vLLM (use_vllm), or the
        policy itself (the lean engine or HF generate). Last in setting up: vLLM's engine takes the prepared
        policy's weights (gathered under ZeRO-3)."""
        args = self.args
        context = GenerationContext(self.accelerator, self.processing_class.pad_token_id, frozenset(self.eos_ids),
                                    engine=args.generation_engine, gather_for_generation=args.ds3_gather_for_generation,
                                    pad_to_multiple_of=args.pad_to_multiple_of)
        lengths = self.prompt_lengths()
        inputs = BackendInputs(context, self.unwrapped_model, self.model_wrapped, self.processing_class, args,
                               self.per_process_train_batch_size * self.steps_per_generation,
                               max(lengths) if lengths else None, self.sampling)
        self.policy_sampler = PolicyBackend(inputs)
        if args.generation_backend is not None:
            backend = build_backend(args.generation_backend, inputs)
            self._vllm = backend if isinstance(backend, VLLMBackend) else None  # trainer.vllm_generation
            return backend
        if args.use_vllm:
            self._vllm = build_backend(f"vllm_{args.vllm_mode}", inputs)
        if self.rollout_func is not None:  # TRL's contract: rollout_func(prompts, trainer)
            return RolloutFuncBackend(lambda prompts: self.rollout_func(prompts, self), inputs, engine=self._vllm)
        return self._vllm or self.policy_sampler

    def _generate_asynchronously(self, backend: Backend) -> AsyncRounds:
        """async_generation: ``backend`` behind the producer's pipeline, and the prompts read ahead of training."""
        args = self.args
        twin = self.tool_loop.twin if self.tool_loop is not None else (lambda: None)
        self.async_rounds = AsyncRounds(backend, twin, self.processing_class, self.eos_ids, self.sampling,
                                        self.accelerator, args)
        self.prompt_batches = ReadAhead(self.prompt_batches)
        if self.needs.importance is None and self.accelerator.is_main_process:
            logger.warning(f"async_generation=True without an importance-sampling correction "
                           f"({type(self).__name__}; GRPO's vllm_importance_sampling_correction=True has one): the "
                           f"lag of rounds sampled with older weights is not corrected.")
        return self.async_rounds

    def _generate_ahead(self, step: int, needed: list[int]) -> None:
        """async_generation (trainers/sampling/async_rounds.py): the weight sync when this step is due one, then the
        rounds up to the horizon fed to the producer (read in order; the first run's from the rounds this step
        still needs)."""
        pipeline = self.async_rounds
        if not pipeline.running:  # a train() call's first step: rounds read ahead by an earlier one are read again
            self.prompt_batches.rewind()
            pipeline.start()
            self._next_feed = min((i for i in needed if i not in self._rounds), default=max(needed) + 1)
        if pipeline.due(step):
            pipeline.sync_weights(step)
        while self._first_step(self._next_feed) <= min(pipeline.horizon(step), self.max_steps - 1):
            rows, ids = self._my_rows(self.prompt_batches.read(self._next_feed))
            if self.on_policy(self._next_feed):
                pipeline.feed(Work(self._next_feed, self._first_step(self._next_feed), rows, ids))
            self._next_feed += 1

    # ------------------------------------------------------------------ the generation backend's lifetime

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """BaseTrainer.train; the generation backend is closed when it returns, fails or is stopped by a
        signal (a vLLM engine starts again if generation is needed later: evaluate, a rollout function)."""
        try:
            return super().train(resume_from_checkpoint)
        except (VLLMServerError, GenerationError, RemoteServiceError) as error:
            # raised on every process together (raise_together shares these types)
            raise self._stopped_by_server(error) from error
        finally:
            self.close_generation()

    def _stopped_by_server(self, error: Exception) -> Exception:
        """The vLLM server, a reward server or a sandbox server failed mid-run (it died, or stopped answering), or
        asynchronous generation did: a resumable checkpoint of the last optimizer step (the failed round's prompts
        are not counted as read, see prepare_step; rounds generated ahead neither, see ReadAhead), and the error to
        raise, which says where it is. No checkpoint before the first step: there is nothing to resume."""
        self.run_log.close()
        if self.async_rounds is not None:  # no round is sampled while the checkpoint is written
            self.async_rounds.close()
        step = self.state.global_step
        if step == 0:
            where = "No optimizer step was done, so no checkpoint was written."
        else:
            path = self._checkpoint_now()
            where = (f"Training stopped after step {step}; checkpoint written to {path}. Restart the server and "
                     f"resume with trainer.train(resume_from_checkpoint=True) (or --resume_from_checkpoint true).")
        if self.accelerator.is_main_process:
            logger.error(f"{error} {where}")
        return type(error)(f"{error} {where}")

    def end(self) -> None:
        self.close_generation()
        super().end()

    def close_generation(self) -> None:
        """The end of the backend's lifetime (a vLLM engine shut down, a server's client closed) and of the tool
        loop's threads; idempotent. Used again later (evaluate, a rollout function), each starts anew."""
        for backend in (self.backend, self._vllm):
            if backend is not None:
                backend.close()
        if self.tool_loop is not None:
            self.tool_loop.close()
