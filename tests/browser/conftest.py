"""A real headless Chromium driven by Selenium against pytest-django's live server.

Debian's chromium and chromium-driver are used as installed (/usr/bin/chromium,
/usr/bin/chromedriver; CHROMIUM / CHROMEDRIVER override), so nothing is downloaded. Without them,
or without selenium, every browser test is skipped. Screenshots go to TASKFLOW_SCREENSHOTS, or
to screenshots/ under TASKFLOW_VAR_DIR (git-ignored var/ by default), for CI to keep.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
WAIT = 20.0  # seconds for a page or element; generous for a loaded CI machine
PASSWORD = "console-pw-1"


def screenshot_dir() -> Path:
    path = Path(os.environ.get("TASKFLOW_SCREENSHOTS") or Path(settings.VAR_DIR) / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def chromium() -> Iterator[object]:
    """One headless Chromium for the whole run (starting one costs about a second)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(path)):
            pytest.skip(f"{path} not found (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--window-size=1500,1100",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT * 3)
    yield driver
    driver.quit()


class Console:
    """The console as a user sees it: pages, links, forms and messages."""

    def __init__(self, driver, base_url: str) -> None:  # noqa: ANN001
        from selenium.webdriver.common.by import By

        self.driver, self.base_url, self.by = driver, base_url, By

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def login(self, username: str) -> None:
        self.driver.delete_all_cookies()
        self.open("/admin/login/?next=/admin/")
        self.find("#id_username").send_keys(username)
        self.find("#id_password").send_keys(PASSWORD)
        self.follow('input[type="submit"]')
        self.find("#user-tools")  # "Welcome, ...": only once logged in

    def find(self, css: str):  # noqa: ANN201
        from selenium.webdriver.support import expected_conditions as ec
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, WAIT).until(ec.presence_of_element_located((self.by.CSS_SELECTOR, css)))

    def all(self, css: str) -> list:
        return self.driver.find_elements(self.by.CSS_SELECTOR, css)

    def click(self, css: str) -> None:
        """Click something that stays on the page (a checkbox, a script's link)."""
        self.find(css).click()

    def follow(self, css: str) -> None:
        """Click a link or submit button and wait until the next page replaced this one."""
        self._leaving(lambda: self.find(css).click())

    def click_link(self, text: str) -> None:
        """Click a link a script handles (it stays on the page)."""
        self._link(text).click()

    def follow_link(self, text: str) -> None:
        self._leaving(self._link(text).click)

    def _link(self, text: str):  # noqa: ANN202
        from selenium.webdriver.support import expected_conditions as ec
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, WAIT).until(ec.element_to_be_clickable((self.by.LINK_TEXT, text)))

    def _leaving(self, action: Callable[[], object]) -> None:
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        # A mark on this page's window: the next page's window has none. (Waiting for an element
        # of this page to go stale races with the navigation: Chromium may report the node as
        # belonging to no document instead.)
        self.driver.execute_script("window.tfLeaving = true")
        action()
        WebDriverWait(self.driver, WAIT, ignored_exceptions=(WebDriverException,)).until(
            lambda driver: driver.execute_script("return !window.tfLeaving && document.readyState === 'complete'")
        )

    def type(self, css: str, text: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(text)

    def choose(self, css: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.find(css)).select_by_value(value)

    def text(self, css: str = "body") -> str:
        return self.find(css).text

    def messages(self) -> list[str]:
        self.find("ul.messagelist")
        return [li.text for li in self.all("ul.messagelist li")]

    def screenshot(self, name: str) -> Path:
        """The whole page (the window grown to its height for the shot) as <name>.png."""
        path = screenshot_dir() / f"{name}.png"
        size = self.driver.get_window_size()
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(size["width"], min(max(height, size["height"]), 6000))
        try:
            self.driver.save_screenshot(str(path))
        finally:
            self.driver.set_window_size(size["width"], size["height"])
        return path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def console(request: pytest.FixtureRequest, chromium, live_server, transactional_db) -> Iterator[Console]:  # noqa: ANN001
    page = Console(chromium, live_server.url)
    yield page
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        # What the browser showed when the test failed, kept with the other screenshots.
        page.screenshot(f"failed-{request.node.name}")
    # A live page (taskflow/admin/live.py) would go on asking the server, which stops with the test.
    chromium.get("about:blank")


@pytest.fixture
def make_user(transactional_db) -> Callable[..., User]:  # noqa: ANN001
    def make(username: str, *codenames: str, superuser: bool = False) -> User:
        if superuser:
            return User.objects.create_superuser(username, f"{username}@example.com", PASSWORD)
        user = User.objects.create_user(username, password=PASSWORD, is_staff=True)
        user.user_permissions.set(Permission.objects.filter(content_type__app_label="taskflow", codename__in=codenames))
        return user

    return make
