// What every browser script shares: headless Debian Chromium through npm
// playwright-core, a deadline per wait, and the run of one script body
// (the browser closed however it ends; any failure exits non-zero).
"use strict";
const { chromium } = require(process.env.PLAYWRIGHT_CORE);

const WAIT = 30000;

function run(body) {
  (async () => {
    const browser = await chromium.launch({
      executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
      args: ["--no-sandbox", "--headless=new", "--disable-gpu"],
    });
    try {
      await body(browser);
    } finally {
      await browser.close();
    }
  })().catch((e) => { console.error(e); process.exit(1); });
}

module.exports = { WAIT, run };
