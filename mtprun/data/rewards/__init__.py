"""Rewards: built-in ones by name, user functions by reference, one calling convention.

registry.REWARDS / register_reward     the built-ins (exact_answer, math, ...)
reference.load_reward(name)            a built-in, `pkg.module:function` or `file.py:function`
reference.reward_problem(name)         what is wrong with a reference (validate)
call.RewardInput / call.call_reward    one episode scored: components with a `total`
endpoint.EndpointJudge                 an LLM judge behind an OpenAI-compatible endpoint
endpoint.render / score_reader         a judge's template filled, its reply read (regex or
                                       function; the judges the run serves share them)
builtin.reasoning_gym                  a reasoning-gym dataset's own score_answer
"""

from mtprun.data.rewards import builtin  # noqa: F401 (registers the built-in rewards)
from mtprun.data.rewards.call import REWARD_ARGUMENTS, RewardInput, RewardValueError, call_reward
from mtprun.data.rewards.reference import RewardReferenceError, load_reward, reward_problem
from mtprun.data.rewards.registry import REWARDS, register_reward

__all__ = [
    "REWARDS",
    "REWARD_ARGUMENTS",
    "RewardInput",
    "RewardReferenceError",
    "RewardValueError",
    "call_reward",
    "load_reward",
    "register_reward",
    "reward_problem",
]
