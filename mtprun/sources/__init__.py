"""Sources: where a task's prompts come from, what kind of task it is, what scores its
episodes. One unit module per source, like the loss kinds:

    rewards/function.py   a built-in reward's name or a function of the user's (`file.py:f`)
    rewards/endpoint.py   an LLM judge behind an OpenAI-compatible endpoint
    rewards/served.py     a reward model the run serves (a classifier or a judge)
    prompts/dataset.py    a local dataset of prompts
    prompts/reasoning_gym.py   a reasoning-gym dataset (its own scorer)
    tasks/builtin.py      the built-in synthetic tasks (arithmetic, calculator_tool, ...)
    tasks/prompts.py      a task whose prompts are a prompt source (task.prompts)
    tasks/verifiers.py    a verifiers taskset (task.environment: verifiers:...)
    tasks/search.py       Search-R1 (task.search)

A unit module holds its `type:`-tagged config (a member of the recipe's union), its preflight
check and its factory; the contracts and the only lists of units are the extension points of
`mtprun.spec.sources`, which derive the recipe unions, the inference of an untagged value's
tag, and the dispatch the layers above use (`reward_source`, `prompt_source`, `task_source`).
Adding a source is its module, its tests and its line in that list.

Where the units sit between the layers. The recipe language (mtprun.spec) is the ground floor,
and a unit's config is part of it; its check and factory run on the data layer. So a unit
module imports, at its top, only the recipe language (and this package's own helpers, which do
the same); its check and factory import the data layer (or the preflight helpers) inside the
function, when they run. The spec names the units by import path (mtprun.units) and imports
them to build its unions, which therefore loads nothing above it. No unit imports the runner:
a reward's factory returns a plain description of how to score (mtprun.sources.scoring:
reward functions in worker processes, a judge called from threads, a model served on an actor
of its own), which the runner's scorer runs; a task's factory returns the data layer's `Task`.
"""
