// Answers an approval from the dashboard in headless Chromium.
// Usage: node approvals.cjs <base-url>
// Waits for the pending ask the Rust test causes, checks what it shows,
// clicks "allow once", and prints a JSON line with what it saw.
"use strict";
const { chromium } = require(process.env.PLAYWRIGHT_CORE);

const [base] = process.argv.slice(2);
const WAIT = 30000;

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--headless=new", "--disable-gpu"],
  });
  try {
    const page = await browser.newPage();
    await page.goto(base);
    await page.waitForSelector("#approvals li.approval", { timeout: WAIT });
    const shown = await page.locator("#approvals li.approval").first().textContent();
    await page.locator('#approvals button[data-outcome="allowed-once"]').first().click();
    await page.waitForFunction(
      () => document.getElementById("approvals").hidden, null, { timeout: WAIT });
    console.log(JSON.stringify({ shown }));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.error(e); process.exit(1); });
