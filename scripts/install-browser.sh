#!/usr/bin/env bash
# Headless Chromium and its driver from the distribution's packages, for the live page's
# browser test (tests/test_live_page.py). Does nothing where they are installed already.
# Fails loudly (exit 1, saying why) where they cannot be had: the browser test must run,
# never skip quietly. MLX_RELAY_NO_BROWSER=1 opts out on a machine that cannot have them
# (a Mac without Chromium): the test then skips saying why, except under CI=true, where
# it fails.
set -u
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ]; }
if have chromium && have chromedriver; then
    exit 0
fi
refuse() {
    if [ "${MLX_RELAY_NO_BROWSER:-}" = 1 ]; then
        echo "install-browser: $1; MLX_RELAY_NO_BROWSER=1: the live page's browser test will skip" >&2
        exit 0
    fi
    echo "install-browser: FAILED: $1." >&2
    echo "  Install chromium and chromedriver (as root: apt-get install chromium chromium-driver)," >&2
    echo "  or set MLX_RELAY_NO_BROWSER=1 to go on without the live page's browser test." >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 || refuse "no chromium/chromedriver and no apt-get to install them"
[ "$(id -u)" = 0 ] || refuse "no chromium/chromedriver, and not root to apt-get them"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/tmp/install-browser.log 2>&1; then
    tail -20 /tmp/install-browser.log >&2
    refuse "apt-get install chromium chromium-driver failed (the log's end above, all of it in /tmp/install-browser.log)"
fi
have chromium && have chromedriver || refuse "apt-get ran but chromium or chromedriver is still missing"
