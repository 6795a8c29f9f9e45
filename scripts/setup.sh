#!/usr/bin/env bash
# Install what amqpbroker needs on a fresh Debian/Ubuntu machine: the system
# libraries python-qpid-proton compiles against (OpenSSL for TLS, Cyrus SASL),
# a virtualenv in .venv, and the package with the extras in AMQPBROKER_EXTRAS
# (default: test,spark — what the test suite needs; empty for just the broker).
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
# proton silently builds without TLS when OpenSSL headers are missing: fail loudly.
.venv/bin/python -c "import proton, sys; sys.exit(0 if proton.SSL.present() else 'python-qpid-proton was built without TLS')"
