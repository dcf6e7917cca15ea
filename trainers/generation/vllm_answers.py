"""What a vLLM server's answers hold, read into the trainer's shapes: the sampled tokens' log-probs (the OpenAI
route's and the token route's) and the weight version of each token (in-flight weight updates)."""

import math


def parse_logprobs(choices_logprobs: list[dict | None]) -> tuple[list | None, list | None]:
    """/v1/completions log-probs -> ([row][token][k] values, [row][token][k] token ids) by descending probability,
    the sampled token always among them, as TRL's ``parse_logprobs``; NaN becomes None; (None, None) when the
    request asked for none."""
    if not choices_logprobs or choices_logprobs[0] is None:
        return None, None
    values, token_ids = [], []
    for logprobs in choices_logprobs:
        row_values, row_ids = [], []
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            ranked = {token: logprob, **(top or {})}  # the sampled token even when it is not among the top ones
            items = sorted(ranked.items(), key=lambda item: -sortable(item[1]))
            row_ids.append([int(name.removeprefix("token_id:")) for name, _ in items])
            row_values.append([None if value is None or math.isnan(value) else value for _, value in items])
        values.append(row_values)
        token_ids.append(row_ids)
    return values, token_ids


def parse_token_logprobs(choices_logprobs: list[dict | None]) -> tuple[list | None, list | None]:
    """/inference/v1/generate log-probs (``content``: per token its ``token_id``, ``logprob`` and ``top_logprobs``)
    -> the shape ``parse_logprobs`` gives."""
    if not choices_logprobs or choices_logprobs[0] is None:
        return None, None
    values, token_ids = [], []
    for logprobs in choices_logprobs:
        row_values, row_ids = [], []
        for token in logprobs["content"] or []:
            ranked = {token["token_id"]: token["logprob"]}
            ranked.update({top["token_id"]: top["logprob"] for top in token.get("top_logprobs") or []})
            items = sorted(ranked.items(), key=lambda item: -sortable(item[1]))
            row_ids.append([int(token_id) for token_id, _ in items])
            row_values.append([None if value is None or math.isnan(value) else value for _, value in items])
        values.append(row_values)
        token_ids.append(row_ids)
    return values, token_ids


def token_versions(spans: list[dict] | None, length: int) -> list[int | None]:
    """vLLM's weight-version spans of one completion (``[{"version", "start", "end"}]`` over its token indexes)
    -> one version per token; a span of no version given (vLLM's ``"default"``: before any tagged update) or no
    spans at all -> None."""
    versions: list[int | None] = [None] * length
    for span in spans or []:
        version = span["version"]
        value = int(version) if isinstance(version, int) or str(version).lstrip("-").isdigit() else None
        versions[span["start"]:span["end"]] = [value] * (min(span["end"], length) - span["start"])
    return versions


def finite_or_minus_inf(value: float | None) -> float:
    return -math.inf if value is None or math.isnan(value) else float(value)


def sortable(value: float | None) -> float:
    return -math.inf if value is None or math.isnan(value) else value
