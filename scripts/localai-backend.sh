#!/usr/bin/env bash
# An mlx-relay cluster as a LocalAI external backend. LocalAI runs this script with
# "--addr HOST:PORT" appended, polls Health there until it says OK, then calls LoadModel:
#
#   local-ai run --external-grpc-backends "mlx-relay:/path/to/mlx-relay/scripts/localai-backend.sh"
#
# The cluster comes from the environment (LocalAI passes its own on):
#   MLX_RELAY_MODEL         the model every rank loads (default: default)
#   MLX_RELAY_RANKS         ranks on this machine for `mlx-relay local` (default: 2)
#   MLX_RELAY_HOSTFILE      a hostfile: `mlx-relay launch` across machines instead
#   MLX_RELAY_GRPC_ADDRESS  the cluster's own gRPC door (default: 127.0.0.1:50051)
#   LOCALAI_GRPC_AUTH_TOKEN LocalAI's token, required on the LocalAI door when set
# Other arguments go to every rank's `serve` (e.g. --max-active 16). SIGTERM from
# LocalAI shuts every rank down cleanly.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
relay="${MLX_RELAY_BIN:-$root/.venv/bin/mlx-relay}"
[ -x "$relay" ] || relay="mlx-relay"

addr=""
rest=()
while (($#)); do
  case "$1" in
    --addr) addr="${2:-}"; shift 2 || shift ;;
    --addr=*) addr="${1#--addr=}"; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ -z "$addr" ]; then
  echo "localai-backend.sh: LocalAI starts this with --addr HOST:PORT" >&2
  exit 2
fi

serve=(--model "${MLX_RELAY_MODEL:-default}"
       --grpc-address "${MLX_RELAY_GRPC_ADDRESS:-127.0.0.1:50051}"
       --localai-address "$addr" ${rest[@]+"${rest[@]}"})
if [ -n "${MLX_RELAY_HOSTFILE:-}" ]; then
  exec "$relay" launch --hostfile "$MLX_RELAY_HOSTFILE" -- "${serve[@]}"
fi
exec "$relay" local -n "${MLX_RELAY_RANKS:-2}" "${serve[@]}"
