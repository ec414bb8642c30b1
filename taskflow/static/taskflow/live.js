/* taskflow console: live pages (taskflow/admin/live.py, docs/console.md "Live pages").
 *
 * Every few seconds, fetch this page's own URL again and bring the regions the control names
 * (#tf-live data-regions) up to date, changing only the nodes that differ. What the operator is
 * doing is kept: ticked rows and the chosen action of the task list, the scroll position, text
 * being selected, and any field being typed in (its region waits for the next round).
 * Pause/resume is remembered by this browser (localStorage).
 * No dependency; without this script the pages are ordinary pages.
 */
"use strict";
(function () {
    const PAUSED_KEY = "taskflow.live.paused";

    function isPaused() {
        try {
            return window.localStorage.getItem(PAUSED_KEY) === "1";
        } catch (e) {
            return false; // storage refused: live, and the button still pauses this page
        }
    }

    function rememberPaused(paused) {
        try {
            window.localStorage.setItem(PAUSED_KEY, paused ? "1" : "0");
        } catch (e) {
            /* not remembered beyond this page */
        }
    }

    function rowKey(row) {
        const box = row.querySelector("input.action-select");
        if (box) {
            return box.value;
        }
        const link = row.querySelector("th a, td a");
        return link ? link.getAttribute("href") : null;
    }

    function rowsByKey(table) {
        const rows = new Map();
        if (table) {
            for (const row of table.querySelectorAll("tbody tr")) {
                rows.set(rowKey(row), row);
            }
        }
        return rows;
    }

    function editing(region) {
        const active = document.activeElement;
        return Boolean(
            active && active !== document.body && region.contains(active) &&
            active.matches("input:not([type=checkbox]):not([type=hidden]), select, textarea")
        );
    }

    function sameShape(a, b) {
        if (a.length !== b.length) {
            return false;
        }
        for (let i = 0; i < a.length; i++) {
            if (a[i].nodeType !== b[i].nodeType || a[i].nodeName !== b[i].nodeName) {
                return false;
            }
        }
        return true;
    }

    // Make `here` look like `there`, touching only what differs: the nodes an operator is reading,
    // selecting text in or typing into stay the same nodes. Form fields keep their own state.
    function morph(here, there) {
        if (here.isEqualNode(there)) {
            return;
        }
        if (here.nodeType === Node.TEXT_NODE) {
            here.data = there.data;
            return;
        }
        if (here.nodeType !== Node.ELEMENT_NODE || here.matches("input, select, textarea")) {
            return;
        }
        for (const name of here.getAttributeNames()) {
            if (!there.hasAttribute(name)) {
                here.removeAttribute(name);
            }
        }
        for (const name of there.getAttributeNames()) {
            if (here.getAttribute(name) !== there.getAttribute(name)) {
                here.setAttribute(name, there.getAttribute(name));
            }
        }
        if (!sameShape(here.childNodes, there.childNodes)) {
            if (!here.querySelector("input, select, textarea")) {
                here.innerHTML = there.innerHTML;
            }
            return;
        }
        for (let i = 0; i < here.childNodes.length; i++) {
            morph(here.childNodes[i], there.childNodes[i]);
        }
    }

    // The task list's form. Its checkboxes carry the operator's selection: while the rows are the
    // same tasks they are updated in place; when tasks came or went, the list is replaced only if
    // nothing is ticked, no "select all" and no action is chosen (else only the rows still there
    // are updated, and the new ones wait).
    function swapChangelist(here, there) {
        const mine = rowsByKey(here.querySelector("#result_list"));
        const theirs = rowsByKey(there.querySelector("#result_list"));
        const keys = Array.from(theirs.keys());
        const sameRows = mine.size === theirs.size && Array.from(mine.keys()).every((k, i) => keys[i] === k);
        if (sameRows) {
            morph(here, there);
            return true;
        }
        const ticked = here.querySelectorAll("input.action-select:checked").length > 0;
        const across = Array.from(here.querySelectorAll("input.select-across")).some((i) => i.value === "1");
        const action = here.querySelector("select[name=action]");
        if (!ticked && !across && !(action && action.value) && !editing(here)) {
            here.innerHTML = there.innerHTML;
            const boxes = document.querySelectorAll("tr input.action-select");
            if (boxes.length && window.Actions) {
                window.Actions(boxes); // Django's actions.js, bound to the new rows
            }
            return true;
        }
        for (const [key, row] of mine) {
            if (theirs.has(key)) {
                morph(row, theirs.get(key));
            }
        }
        return false;
    }

    function swap(here, there) {
        if (here.id === "changelist-form") {
            return swapChangelist(here, there);
        }
        if (editing(here)) {
            return false;
        }
        morph(here, there);
        return true;
    }

    function start() {
        const control = document.getElementById("tf-live");
        if (!control || !window.fetch || !window.DOMParser) {
            return;
        }
        const interval = Math.max(0.2, parseFloat(control.dataset.interval) || 5) * 1000;
        const regions = (control.dataset.regions || "").split(",").filter(Boolean);
        const button = control.querySelector(".tf-live-toggle");
        const status = control.querySelector(".tf-live-status");
        let timer = null;
        let stopped = false;

        function say(text) {
            status.textContent = text;
        }

        function show() {
            const paused = isPaused();
            button.textContent = paused ? "Resume" : "Pause";
            button.setAttribute("aria-pressed", paused ? "true" : "false");
            control.classList.toggle("tf-live-paused", paused);
            if (paused) {
                say("Auto-refresh paused");
            }
        }

        function schedule() {
            window.clearTimeout(timer);
            if (!isPaused() && !stopped) {
                timer = window.setTimeout(refresh, interval);
            }
        }

        async function refresh() {
            if (isPaused()) {
                return;
            }
            if (document.hidden) {
                schedule(); // a background tab asks the server for nothing
                return;
            }
            try {
                const response = await fetch(window.location.href, {
                    credentials: "same-origin",
                    cache: "no-store",
                    headers: {"X-Requested-With": "taskflow-live"},
                });
                if (response.redirected || response.status === 403 || response.status === 404) {
                    // Signed out, or the page is gone: a refresh cannot fix that.
                    stopped = true;
                    say("Auto-refresh stopped: reload the page");
                    return;
                }
                if (!response.ok) {
                    throw new Error("HTTP " + response.status);
                }
                const page = new DOMParser().parseFromString(await response.text(), "text/html");
                let complete = true;
                for (const selector of regions) {
                    const here = document.querySelector(selector);
                    const there = page.querySelector(selector);
                    if (here && there && !isPaused()) {
                        complete = swap(here, there) && complete;
                    }
                }
                if (!isPaused()) {
                    const time = new Date().toLocaleTimeString([], {hour12: false});
                    say("Updated " + time + (complete ? "" : " (new rows wait while rows are selected)"));
                }
            } catch (error) {
                say("Refresh failed (" + error.message + "); trying again");
            }
            schedule();
        }

        button.addEventListener("click", function () {
            rememberPaused(!isPaused());
            show();
            if (!isPaused()) {
                say("Auto-refresh on");
            }
            schedule();
        });
        // Paused or resumed in another tab of this browser.
        window.addEventListener("storage", function (event) {
            if (event.key === PAUSED_KEY) {
                show();
                schedule();
            }
        });
        control.hidden = false;
        show();
        schedule();
    }

    if (document.readyState === "loading") {
        document.addEventListener("DOMContentLoaded", start);
    } else {
        start();
    }
})();
