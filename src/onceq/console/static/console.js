// onceq console: the live parts of a page. An element with data-live="URL" is replaced
// by a fresh copy from URL every data-every milliseconds while the page is visible; the
// server reads the broker only on those requests, so a closed or hidden page costs the
// broker nothing.
(function () {
  "use strict";
  function refresh(el) {
    if (document.hidden || el.dataset.busy) { return; }
    el.dataset.busy = "1";
    fetch(el.dataset.live, { headers: { "X-Console-Live": "1" }, cache: "no-store" })
      .then(function (r) { return r.text(); })
      .then(function (html) {
        el.innerHTML = html;
        el.classList.remove("stale");
        el.dataset.updated = String(Date.now());
      })
      .catch(function () { el.classList.add("stale"); })
      .finally(function () { delete el.dataset.busy; });
  }
  function start() {
    document.querySelectorAll("[data-live]").forEach(function (el) {
      var every = parseInt(el.dataset.every || "2000", 10);
      window.setInterval(function () { refresh(el); }, Math.max(every, 250));
    });
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden) { document.querySelectorAll("[data-live]").forEach(refresh); }
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else { start(); }
})();
