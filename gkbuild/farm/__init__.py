"""``gkbuild farm``: compile the programs of many recipes as independent jobs (on local processes or
a Ray cluster) that meet in the shared compile cache.

    plan.py     every program of every recipe (and variant), its compile key, and whether the
                cache already holds it
    job.py      one job: trace and compile one program from the recipe text and the model config
                alone, then push it to the cache
    local.py    jobs on this host's processes
    ray_run.py  jobs as Ray tasks (imported only with ``--executor ray``)
"""

# Recipes x --vary variants one farm plans: each is a recipe check and a plan (15-25 ms a tiny one), and a
# cross product grows fast (three --vary of 100 values are a million plans).
MAX_PLANS = 1024
