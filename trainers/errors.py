"""The project's errors. Each message names the culprit (option, column, function or path) and what would be
valid; all derive from ``TrainersError`` (a ``ValueError``), so "one of our clear errors" is one except clause."""


class TrainersError(ValueError):
    """Base class of every error this project raises about its input."""


class ConfigError(TrainersError):
    """An option has an invalid value, or does not exist."""


class DatasetFormatError(TrainersError):
    """A dataset lacks the columns or values a trainer needs."""


class DatasetTypeError(DatasetFormatError, TypeError):
    """A dataset of a type the trainer cannot take (e.g. a DatasetDict of splits); a TypeError too, as TRL raises."""


class ModelLoadError(TrainersError):
    """A model or tokenizer could not be loaded."""


class RewardFunctionError(TrainersError):
    """A reward function is invalid, raised, or returned something unusable."""


class RolloutError(TrainersError):
    """A GRPO rollout_func raised, or returned something the trainer cannot train on."""


class VLLMServerError(RolloutError):
    """The vLLM server (vllm_mode="server") is unreachable, serves another model, or failed mid-run; the message
    names its URL."""


class GenerationError(RolloutError):
    """Generation ahead of training (GRPOConfig.async_generation) failed: the producer raised, or made no progress
    within heartbeat_stale_after_s; the message names the round and the cause."""


class CheckpointError(TrainersError):
    """A checkpoint is missing, incomplete or unreadable."""


class NonFiniteError(TrainersError):
    """Training stopped after too many consecutive non-finite optimizer steps."""


class DistributedError(TrainersError):
    """Another process failed; raised on every process so none waits forever in a collective."""


class RemoteServiceError(RewardFunctionError):
    """A reward server (``trainers reward-serve``) or remote code executor (``trainers sandbox-serve``) could not
    be reached, timed out, refused the key or failed; the message names its URL. The trainer stops with a
    checkpoint, as for a dead vLLM server."""
