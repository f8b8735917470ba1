#!/bin/sh
# mini-swe-agent (PyPI mini-swe-agent==2.4.6, unmodified, in its own virtual environment: `make harness-mini`)
# pointed at Gyre's model proxy. Its model is litellm's "openai/..." route with api_base = OPENAI_BASE_URL and the
# execution token as OPENAI_API_KEY; offline: litellm's bundled cost map, cost tracking off. It runs in yolo mode
# (no confirmation) for at most MINI_STEPS steps and keeps its trajectory in traj.json; its task is GYRE_TASK.
export MSWEA_COST_TRACKING=ignore_errors LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_CONFIGURED=true
exec "${MINI:-mini}" -m openai/gyre-policy -t "$GYRE_TASK" --yolo --exit-immediately -c mini.yaml \
  -c "model.model_kwargs.api_base=$OPENAI_BASE_URL" -c "agent.step_limit=${MINI_STEPS:-3}" -c agent.cost_limit=0 \
  -o traj.json
