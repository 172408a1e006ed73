#!/usr/bin/env bash
# Headless Chromium and its driver from the distribution's packages, for the live page's
# browser test (tests/test_live_page.py). Does nothing where /usr/bin/chromium is there
# already, or where apt-get is missing or we are not root (the test then skips, saying
# why). Never fails the build: a browser that cannot be installed only skips that test.
set -u
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: no apt-get here; the live page's browser test will skip" >&2
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-browser: not root; the live page's browser test will skip" \
         "(as root: apt-get install chromium chromium-driver)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/tmp/install-browser.log 2>&1; then
    echo "install-browser: apt-get failed (see /tmp/install-browser.log);" \
         "the live page's browser test will skip" >&2
fi
exit 0
