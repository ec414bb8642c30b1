from django.apps import AppConfig


class TaskflowConfig(AppConfig):
    name = "taskflow"
    verbose_name = "Taskflow"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks
        from django.db.models.signals import post_migrate
        from django.utils.module_loading import autodiscover_modules

        from .checks import check_history_tables, check_settings
        from .engine import ids, nodes
        from .engine.rolling import sync_after_migrate

        checks.register(check_settings, "taskflow")
        checks.register(check_history_tables, "taskflow", checks.Tags.database)
        # Schema changes to Task reach the history tables rolled out of it (docs/rolling.md).
        post_migrate.connect(sync_after_migrate, sender=self)
        # The id generator knows nothing of the database; its node numbers are leased here.
        ids.use_node_source(nodes.node_source())
        # Handlers live in each installed app's tasks.py, as with Django's own task modules.
        autodiscover_modules("tasks")
