#!/usr/bin/env bash
# Install what amqpbroker needs on a fresh Debian/Ubuntu machine: the system
# libraries python-qpid-proton compiles against (OpenSSL for TLS, Cyrus SASL),
# a virtualenv in .venv, and the package (editable: this clone) with the extras in
# AMQPBROKER_EXTRAS (default: test,spark,ha — what the test suite needs; empty for
# just the broker, as scripts/run.sh does; `spark` alone for the Spark example,
# with a Java runtime).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

extras=${AMQPBROKER_EXTRAS-test,spark,ha}   # test: pytest & co; spark: pyspark + pyarrow for tests/spark;
                                            # ha: kazoo (docs/ha.md)
pkgs=(libssl-dev libsasl2-dev libsasl2-modules pkg-config openssl gcc python3-dev python3-venv)
# chromium + chromium-driver: the web console's browser tests (pytest -m browser);
# node + npm: rhea over WebSocket in the WebSocket listener's tests.
case ",$extras," in *,test,*) pkgs+=(chromium chromium-driver)
  command -v npm >/dev/null || pkgs+=(nodejs npm) ;; esac
# zookeeper (Debian, 3.8) + a JRE: the HA tests start a real ZooKeeper (tests/e2e/ha_harness.py).
case ",$extras," in *,test,*) pkgs+=(zookeeper default-jre-headless) ;; esac
# Spark runs on a Java runtime (17 or later: Debian 12's default-jre-headless is 17).
case ",$extras," in *,spark,*) command -v java >/dev/null || pkgs+=(default-jre-headless) ;; esac
# Proton C and its example broker: the bench smoke test builds bench/build/ (loadgen, amqp-bench, cbroker).
case ",$extras," in *,test,*) pkgs+=(libqpid-proton11-dev libqpid-proton11-dev-examples) ;; esac
need_pkgs=()
for pkg in "${pkgs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need_pkgs[@]}"
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q -e .
fi
# rhea and ws (pinned in tests/e2e/wsclient/package-lock.json) for the WebSocket tests.
case ",$extras," in *,test,*)
  [ -d tests/e2e/wsclient/node_modules/ws ] || (cd tests/e2e/wsclient && npm ci --no-audit --no-fund --loglevel=error) ;;
esac
# python-qpid-proton compiles its C core at install time and silently leaves out TLS
# without the OpenSSL headers, and SCRAM without the Cyrus SASL headers; pip then
# reuses that wheel from its cache even once the headers are there.  Check both (a
# real SCRAM-SHA-256 exchange in memory), rebuild once from source without the
# cache when something is missing, and fail loudly if it still is.
if ! .venv/bin/python scripts/check_proton.py; then
  proton_req=$(.venv/bin/python -c "from importlib.metadata import requires; print(next(r for r in requires('amqpbroker') if r.startswith('python-qpid-proton')))")
  echo "setup: rebuilding ${proton_req} from source without pip's cache" >&2
  .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps \
    --no-binary python-qpid-proton "${proton_req}"
  .venv/bin/python scripts/check_proton.py || {
    echo "setup: python-qpid-proton still lacks TLS or SCRAM: are libssl-dev, libsasl2-dev and" \
         "libsasl2-modules installed?" >&2; exit 1; }
fi
